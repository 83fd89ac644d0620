# The git commit of weft's source tree: the full hash, "-dirty" appended when
# tracked files differ from it, "unknown" outside a git checkout or without git.
#   include(weftGitCommit) + weft_git_commit(VAR SOURCE_DIR)   (configure time)
#   cmake -DSOURCE_DIR=... -DOUT=file.hpp -P weftGitCommit.cmake
#     (build time: writes #define WEFT_BUILD_COMMIT "..." into OUT, touching
#      the file only when the text changes, so dependents rebuild only then)
function(weft_git_commit var source_dir)
  set(commit "unknown")
  find_package(Git QUIET)
  if(GIT_FOUND)
    execute_process(COMMAND "${GIT_EXECUTABLE}" rev-parse HEAD WORKING_DIRECTORY "${source_dir}"
                    RESULT_VARIABLE rc OUTPUT_VARIABLE head ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(rc EQUAL 0 AND head MATCHES "^[0-9a-f]+$")
      set(commit "${head}")
      execute_process(COMMAND "${GIT_EXECUTABLE}" status --porcelain --untracked-files=no WORKING_DIRECTORY "${source_dir}"
                      RESULT_VARIABLE rc OUTPUT_VARIABLE status ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
      if(rc EQUAL 0 AND NOT status STREQUAL "")
        string(APPEND commit "-dirty")
      endif()
    endif()
  endif()
  set(${var} "${commit}" PARENT_SCOPE)
endfunction()

if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  weft_git_commit(_commit "${SOURCE_DIR}")
  set(_text "// Generated at build time by cmake/weftGitCommit.cmake. Do not edit.\n#pragma once\n#define WEFT_BUILD_COMMIT \"${_commit}\"\n")
  set(_old "")
  if(EXISTS "${OUT}")
    file(READ "${OUT}" _old)
  endif()
  if(NOT _old STREQUAL _text)
    file(WRITE "${OUT}" "${_text}")
  endif()
endif()
