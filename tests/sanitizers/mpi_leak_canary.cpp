// mpi_leak_canary.cpp: proves that tests/sanitizers/lsan.supp hides only the MPI
// runtime's own leaks. scripts/sanitize.sh builds it with AddressSanitizer, runs
// it with the suppressions under mpirun, and requires LeakSanitizer to report
// both leaks below (ours), while the MPI runtime's leaks stay suppressed.
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  char* ours = static_cast<char*>(std::malloc(4242));  // leak 1: a plain allocation of ours
  std::memset(ours, 1, 4242);
  std::printf("canary %d\n", ours[0] + ours[4241]);
  ours = nullptr;
  MPI_Comm dup = MPI_COMM_NULL;  // leak 2: an MPI object we create and never free
  MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  MPI_Finalize();
  return 0;
}
