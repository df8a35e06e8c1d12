# Install rules for the Python wheel (scikit-build-core sets SKBUILD): paths are relative to the wheel's
# platlib, so `vgpu/` is the package folder.
if(NOT TARGET vgpu_native)
  message(FATAL_ERROR "a wheel needs vgpu._native: pybind11 and the Python headers must be found")
endif()
install(TARGETS vgpu_native LIBRARY DESTINATION vgpu COMPONENT python)

# The shared libraries under their run-time names only (libcuda.so.1, libnvidia-ml.so.1, libvgpu.so): wheels
# hold no symlinks, and nothing links against these by their development names.
set(_vgpu_wheel_libraries vgpu fakecuda_cuda fakecuda_nvml)
set(_vgpu_wheel_programs vgpu-tenant vgpu-sampler vgpu-monitor)
foreach(_target IN LISTS _vgpu_wheel_libraries _vgpu_wheel_programs)
  if(NOT TARGET ${_target})
    message(FATAL_ERROR "a wheel needs the target ${_target}, which this tree does not define")
  endif()
endforeach()
install(TARGETS ${_vgpu_wheel_libraries}
        LIBRARY DESTINATION vgpu/_install/lib NAMELINK_SKIP COMPONENT python)
# No install RPATH (CMAKE_INSTALL_RPATH is empty): the driver comes from LD_LIBRARY_PATH, as in the build tree.
install(TARGETS ${_vgpu_wheel_programs} RUNTIME DESTINATION vgpu/_install/bin COMPONENT python)
