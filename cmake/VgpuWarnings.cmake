# Warning flags for the project's own targets (not for third-party code).
# VGPU_WERROR adds -Werror. It is ON in every preset of CMakePresets.json (CI and developers build with those) and
# OFF for a plain `cmake -S . -B build` and for the wheel (pyproject.toml): someone building the tree meets
# compilers, versions and optimization levels it was not tried with, where a new warning must not stop the build.
option(VGPU_WERROR "Treat warnings as errors on the project's own targets (ON in the presets)" OFF)
add_library(vgpu_warnings INTERFACE)
target_compile_options(vgpu_warnings INTERFACE
  -Wall -Wextra -Wshadow -Wnon-virtual-dtor -Wcast-align -Wunused
  -Wno-missing-field-initializers)
if(VGPU_WERROR)
  target_compile_options(vgpu_warnings INTERFACE -Werror)
endif()

# Code that is injected into other people's processes: hidden by default,
# only the symbols named in a version script are exported.
function(vgpu_hidden_shared_library target version_script)
  set_target_properties(${target} PROPERTIES
    CXX_VISIBILITY_PRESET hidden
    C_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
  target_link_options(${target} PRIVATE
    -Wl,--version-script=${version_script}
    -Wl,--no-undefined
    -Wl,-z,defs
    -static-libstdc++ -static-libgcc)
  set_property(TARGET ${target} APPEND PROPERTY LINK_DEPENDS ${version_script})
endfunction()
