# Every Catch2 test name survives CTest's discovery as one test: CMake reads the discovered names as a list, where a
# ';' splits a name and an unbalanced '[' or ']' joins the names up to the next bracket into one test that matches
# nothing (a name with "H[0..k)" once swallowed 80 tests into one that ran none). The check first fails two such
# names of its own (the negative control), then passes every name of the suite.
# ctest-binary: streambp_tests
source "$(dirname "$0")/../support/cli_common.sh"

# Prints each name that CMake's list parsing would not keep whole.
bad_names() {
  awk '{ depth = 0; ok = index($0, ";") == 0
         for (i = 1; i <= length($0); ++i) { c = substr($0, i, 1)
           if (c == "[") ++depth; else if (c == "]" && --depth < 0) ok = 0 }
         if (!ok || depth != 0) print }'
}

control=$(printf '%s\n' "keeps H[0..k) on the host" "one; two" "within [1, rows] is fine" | bad_names)
[[ $control == $'keeps H[0..k) on the host\none; two' ]] || fail "the name check missed a bad name: '$control'"

names=$("$STREAMBP" --list-test-names-only || true)  # (Catch2 v2 exits with the number of names)
(( $(wc -l <<<"$names") > 100 )) || fail "streambp_tests listed too few names"
bad=$(bad_names <<<"$names")
[[ -z $bad ]] || fail "test names CTest's discovery would split or join (no ';', brackets balanced): $bad"
echo "cli_test_names: $(wc -l <<<"$names") names, none split or joined"
