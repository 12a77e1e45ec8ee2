# build_speed.cmake: what makes a clean build of Colibri fast (CI builds from a
# clean checkout on 2 cores, three times: release, ASan+UBSan, libFuzzer).
#
# Unity builds (COLIBRI_UNITY_BUILD, OFF by default; scripts/test.sh,
# scripts/sanitize.sh and scripts/fuzz.sh turn it on): a target's sources are
# compiled in batches of COLIBRI_UNITY_BATCH files, each batch one translation
# unit. What dominates a Colibri translation unit is not its own code but the
# headers' (cxxopts instantiates std::regex in every file that declares options,
# nlohmann::json and fmt their templates) parsed, instantiated and optimised again
# in every file: measured on this 2-core machine, the 13 launcher files take
# 40 s of CPU as one translation unit against ~250 s as 13 (GCC 12, -O3).
# Precompiled headers were measured too: they save only the parsing (~20% of such
# a file at -O3, none of the instantiation and code generation), so they are not used.
#
# colibri_build_speed(TARGET [BATCH N]) turns it on for TARGET. Files that cannot
# share a translation unit (same names in anonymous namespaces, an unqualified
# call that finds another file's overload) are in COLIBRI_UNITY_SKIP and compile
# alone: a new collision shows up as a compile error in a unity build, and the
# fix is to rename the helper or to add its file here.
option(COLIBRI_UNITY_BUILD "Compile each target's sources in a few combined translation units (faster clean builds)" OFF)
set(COLIBRI_UNITY_BATCH 8 CACHE STRING "Sources per unity translation unit (COLIBRI_UNITY_BUILD)")

# Paths relative to the source tree's root.
set(COLIBRI_UNITY_SKIP
  model/file_io.cpp          # its quoted() against std::quoted (ADL) where <iomanip> came first
  model/synth.cpp            # join() also in model/config.cpp
  model/tokenizer_spm.cpp    # format_error() also in model/tokenizer_bpe.cpp
  model/placement.cpp        # kMaxExperts / kMaxLayers also in model/routing_trace.cpp
  coordinator/simulate.cpp   # its Rng against colibri::Rng (coordinator/sampling.h)
)

get_filename_component(COLIBRI_BUILD_SPEED_ROOT "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)

function(colibri_build_speed target)
  cmake_parse_arguments(ARG "" "BATCH" "" ${ARGN})
  if(NOT COLIBRI_UNITY_BUILD)
    return()
  endif()
  set(batch ${COLIBRI_UNITY_BATCH})
  if(ARG_BATCH)
    set(batch ${ARG_BATCH})
  endif()
  set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_MODE BATCH UNITY_BUILD_BATCH_SIZE ${batch})
  # In a unity file every source is an included file, and GCC warns that a
  # GoogleTest fixture in an anonymous namespace is used by a class in a "header".
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wno-subobject-linkage>)
  endif()
  get_target_property(srcs ${target} SOURCES)
  get_target_property(dir ${target} SOURCE_DIR)
  foreach(s IN LISTS srcs)
    if(s MATCHES "^\\$<")
      continue()  # generator expressions ($<TARGET_OBJECTS:...>)
    endif()
    get_filename_component(abs "${s}" ABSOLUTE BASE_DIR "${dir}")
    file(RELATIVE_PATH rel "${COLIBRI_BUILD_SPEED_ROOT}" "${abs}")
    if(rel IN_LIST COLIBRI_UNITY_SKIP)
      set_source_files_properties("${abs}" TARGET_DIRECTORY ${target} PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
    endif()
  endforeach()
endfunction()
