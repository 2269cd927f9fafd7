# The CTest test InstalledPackageBuildsAConsumer: installs this build of ikbo
# into a fresh prefix under WORK_DIR, then configures, builds and runs the
# consumer project of tests/package against it (find_package(ikbo)).
#   cmake -DBUILD_DIR=... -DSOURCE_DIR=... -DWORK_DIR=... -DGENERATOR=...
#         -DCXX_COMPILER=... [-DCUDA_ROOT=...] -P check_package.cmake
foreach(variable BUILD_DIR SOURCE_DIR WORK_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${variable})
    message(FATAL_ERROR "check_package.cmake needs -D${variable}=...")
  endif()
endforeach()

function(run step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE status OUTPUT_VARIABLE output
                  ERROR_VARIABLE output)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "${step} failed (${status}):\n${output}")
  endif()
  message(STATUS "${step}: ok")
  set(output "${output}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
run("cmake --install" "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
set(cuda_hint)
if(CUDA_ROOT)
  set(cuda_hint "-DCUDAToolkit_ROOT=${CUDA_ROOT}")
endif()
run("configure the consumer" "${CMAKE_COMMAND}" -S "${SOURCE_DIR}/tests/package"
    -B "${WORK_DIR}/build" -G "${GENERATOR}" -DCMAKE_BUILD_TYPE=Release
    "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix" ${cuda_hint})
run("build the consumer" "${CMAKE_COMMAND}" --build "${WORK_DIR}/build")
run("run the consumer" "${WORK_DIR}/build/consumer")
message(STATUS "${output}")
