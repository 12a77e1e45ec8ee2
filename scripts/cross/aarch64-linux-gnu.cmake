# CMake toolchain: cross-compile Colibri for aarch64 Linux (Grace-based GPU nodes)
# with Debian's g++-aarch64-linux-gnu against the arm64 multiarch libraries
# (/usr/lib/aarch64-linux-gnu), and run what it builds under qemu-user.
# Used by scripts/cross_check.sh, which installs all of it; by hand:
#   cmake -S . -B build-aarch64 -DCMAKE_TOOLCHAIN_FILE=scripts/cross/aarch64-linux-gnu.cmake \
#         -DCOLIBRI_CUDA=OFF -DCOLIBRI_MPI=OFF -DCOLIBRI_CUDA_EMU=OFF
# with PKG_CONFIG_LIBDIR pointing at the arm64 .pc files (see the script).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
# Debian multiarch: packages for arm64 live in <prefix>/lib/aarch64-linux-gnu, so
# find_package/find_library look there and not in the x86-64 directories (a
# library of the wrong architecture would fail the link, not slip through).
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
# Test executables (gtest_discover_tests, add_test of a target) run under qemu.
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64)
