# Finds NVSHMEM for EPCOMM_WITH_NVSHMEM: NVSHMEM_HOME if set, else the nvidia-nvshmem-cu13 wheel
# of the Python on PATH. Sets EPCOMM_NVSHMEM_INCLUDE, EPCOMM_NVSHMEM_DEVICE_LIB (the static
# device library) and EPCOMM_NVSHMEM_HOST_LIB (the host library; the wheel ships only the
# versioned name libnvshmem_host.so.3).
function(epcomm_find_nvshmem)
  set(home "${NVSHMEM_HOME}")
  if(NOT home)
    find_package(Python3 COMPONENTS Interpreter QUIET)
    if(Python3_Interpreter_FOUND)
      execute_process(
        COMMAND ${Python3_EXECUTABLE} -c
                "import nvidia.nvshmem as m; print(list(m.__path__)[0])"
        OUTPUT_VARIABLE home OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    endif()
  endif()
  if(NOT home OR NOT EXISTS "${home}/include/nvshmem.h")
    message(FATAL_ERROR "EPCOMM_WITH_NVSHMEM: NVSHMEM not found. Set NVSHMEM_HOME, or install the "
                        "wheel: pip install nvidia-nvshmem-cu13==3.4.5")
  endif()
  find_library(_nvshmem_device NAMES nvshmem_device PATHS "${home}/lib" NO_DEFAULT_PATH)
  find_file(_nvshmem_host NAMES libnvshmem_host.so libnvshmem_host.so.3 PATHS "${home}/lib"
            NO_DEFAULT_PATH)
  if(NOT _nvshmem_device OR NOT _nvshmem_host)
    message(FATAL_ERROR "EPCOMM_WITH_NVSHMEM: ${home}/lib lacks libnvshmem_device.a or "
                        "libnvshmem_host.so")
  endif()
  message(STATUS "NVSHMEM: ${home}")
  set(EPCOMM_NVSHMEM_INCLUDE "${home}/include" PARENT_SCOPE)
  set(EPCOMM_NVSHMEM_DEVICE_LIB "${_nvshmem_device}" PARENT_SCOPE)
  set(EPCOMM_NVSHMEM_HOST_LIB "${_nvshmem_host}" PARENT_SCOPE)
endfunction()
