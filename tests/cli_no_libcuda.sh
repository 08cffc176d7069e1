# The binary must start on a machine without a GPU driver: libcuda.so.1 is never a direct dependency (DESIGN §10),
# and it does start here (these machines have no driver).
source "$(dirname "$0")/cli_common.sh"
needed=$(readelf -d "$STREAMBP" | grep NEEDED)
echo "$needed"
if grep -q 'libcuda\.so' <<<"$needed"; then fail "libcuda is NEEDED by $STREAMBP"; fi
"$STREAMBP" --help >/dev/null
echo "ok: no libcuda NEEDED, and the binary starts"
