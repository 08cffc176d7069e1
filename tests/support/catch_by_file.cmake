# CMake script (-P), run after streambp_tests is built: one CTest test per source file of the cases matching SPEC
# (Catch2's --filenames-as-tags tags each case with its file, [#test_x]), all in one process instead of one per case.
# The sanitized tree uses it: a sanitized process takes ~1 s to start (ASan and libtorch), longer than most of its
# cases, and none of its cases reads the memory meter, whose counts need a fresh process.
#   -D EXE=binary -D SPEC=catch-spec -D PREFIX=name-prefix -D ENVIRONMENT=VAR=value -D OUT=file.cmake
#   [-D FIRST=file,file]: files whose tests ctest -j starts before the others (COST)
cmake_policy(SET CMP0057 NEW)  # if(IN_LIST) in a -P script
execute_process(COMMAND "${EXE}" --filenames-as-tags "${SPEC}" --list-tags OUTPUT_VARIABLE listing RESULT_VARIABLE status)
if(NOT listing MATCHES "Tags for matching test cases")  # Catch2 2.x exits with the number of tags it listed
  message(FATAL_ERROR "${EXE} --list-tags exited ${status}:\n${listing}")
endif()
string(REGEX MATCHALL "\\[#[A-Za-z0-9_]+\\]" files "${listing}")
string(REPLACE "," ";" FIRST "${FIRST}")
set(content "")
foreach(file_tag IN LISTS files)
  string(REGEX REPLACE "\\[#(.*)\\]" "\\1" name "${file_tag}")
  string(APPEND content "add_test([=[${PREFIX}${name}]=] [=[${EXE}]=] --filenames-as-tags --warn NoTests [=[${file_tag}${SPEC}]=])\n"
                        "set_tests_properties([=[${PREFIX}${name}]=] PROPERTIES ENVIRONMENT [=[${ENVIRONMENT}]=])\n")
  if(name IN_LIST FIRST)
    string(APPEND content "set_tests_properties([=[${PREFIX}${name}]=] PROPERTIES COST 1000)\n")
  endif()
endforeach()
file(WRITE "${OUT}" "${content}")
