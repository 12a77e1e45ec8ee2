// cublaslt_loader.cpp: cuBLASLt, loaded on first use instead of at start-up.
//
// Linking libcublasLt.so (540 MB) costs every process ~60 ms of CPU when it
// starts (the dynamic linker relocates it and runs its initialisers), GPU or
// not: `colibri --help` on a laptop, every worker rank, every test process.
// The engine calls the 15 functions below, all from the GPU expert FFN
// (kernels/cuda/ffn.cu); this file defines them, and the first call loads the
// library with dlopen and forwards every call to its symbols. When it cannot
// be loaded, each call returns CUBLAS_STATUS_NOT_INITIALIZED, and
// cublasLtGetStatusString says which file failed and why (the checks in
// cuda_check.h put that into the error they throw).
#include <cublasLt.h>
#include <dlfcn.h>

#include <mutex>
#include <string>

namespace {

#define COLIBRI_LT_STR2(x) #x
#define COLIBRI_LT_STR(x) COLIBRI_LT_STR2(x)
constexpr const char* kLtSoname = "libcublasLt.so." COLIBRI_LT_STR(CUBLAS_VER_MAJOR);

// X(name): every function the engine calls.
#define COLIBRI_LT_FUNCTIONS(X)                                                                          \
  X(cublasLtCreate) X(cublasLtDestroy) X(cublasLtGetStatusName) X(cublasLtGetStatusString) X(cublasLtMatmul) \
  X(cublasLtMatmulAlgoGetHeuristic) X(cublasLtMatmulDescCreate) X(cublasLtMatmulDescDestroy)              \
  X(cublasLtMatmulDescSetAttribute) X(cublasLtMatmulPreferenceCreate) X(cublasLtMatmulPreferenceDestroy)  \
  X(cublasLtMatmulPreferenceSetAttribute) X(cublasLtMatrixLayoutCreate) X(cublasLtMatrixLayoutDestroy)    \
  X(cublasLtMatrixLayoutSetAttribute)

struct LtLibrary {
#define COLIBRI_LT_POINTER(name) decltype(&::name) name = nullptr;
  COLIBRI_LT_FUNCTIONS(COLIBRI_LT_POINTER)
#undef COLIBRI_LT_POINTER
  bool ok = false;
  std::string error;  // why it did not load
};

const LtLibrary& lt_library() {
  static LtLibrary lib;
  static std::once_flag once;
  std::call_once(once, [] {
    // The soname first (the executable's run path, LD_LIBRARY_PATH, the
    // system's), then the toolkit this was built against.
    void* h = dlopen(kLtSoname, RTLD_NOW | RTLD_LOCAL);
#ifdef COLIBRI_CUDA_LIBRARY_DIR
    if (!h) h = dlopen((std::string(COLIBRI_CUDA_LIBRARY_DIR) + "/" + kLtSoname).c_str(), RTLD_NOW | RTLD_LOCAL);
#endif
    if (!h) {
      const char* e = dlerror();
      lib.error = std::string(kLtSoname) + " could not be loaded: " + (e ? e : "unknown error");
      return;
    }
#define COLIBRI_LT_LOAD(name)                                                        \
  lib.name = reinterpret_cast<decltype(&::name)>(dlsym(h, #name));                   \
  if (!lib.name) {                                                                   \
    lib.error = std::string(kLtSoname) + " has no symbol " #name " (a different cuBLAS version?)"; \
    return;                                                                          \
  }
    COLIBRI_LT_FUNCTIONS(COLIBRI_LT_LOAD)
#undef COLIBRI_LT_LOAD
    lib.ok = true;
  });
  return lib;
}

// Forwards a call to the library's function, or returns
// CUBLAS_STATUS_NOT_INITIALIZED when the library did not load.
#define COLIBRI_LT_CALL(name, ...)                                  \
  const LtLibrary& lib_ = lt_library();                             \
  if (!lib_.ok) return CUBLAS_STATUS_NOT_INITIALIZED;               \
  return lib_.name(__VA_ARGS__)

}  // namespace

extern "C" {

cublasStatus_t CUBLASWINAPI cublasLtCreate(cublasLtHandle_t* h) { COLIBRI_LT_CALL(cublasLtCreate, h); }
cublasStatus_t CUBLASWINAPI cublasLtDestroy(cublasLtHandle_t h) { COLIBRI_LT_CALL(cublasLtDestroy, h); }

const char* CUBLASWINAPI cublasLtGetStatusName(cublasStatus_t s) {
  const LtLibrary& lib = lt_library();
  if (!lib.ok) return s == CUBLAS_STATUS_NOT_INITIALIZED ? "CUBLAS_STATUS_NOT_INITIALIZED" : "CUBLAS_STATUS_?";
  return lib.cublasLtGetStatusName(s);
}

const char* CUBLASWINAPI cublasLtGetStatusString(cublasStatus_t s) {
  const LtLibrary& lib = lt_library();
  if (!lib.ok) return lib.error.c_str();
  return lib.cublasLtGetStatusString(s);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void* alpha,
                                           const void* A, cublasLtMatrixLayout_t Ad, const void* B,
                                           cublasLtMatrixLayout_t Bd, const void* beta, const void* C,
                                           cublasLtMatrixLayout_t Cd, void* D, cublasLtMatrixLayout_t Dd,
                                           const cublasLtMatmulAlgo_t* algo, void* workspace,
                                           size_t workspace_bytes, cudaStream_t stream) {
  COLIBRI_LT_CALL(cublasLtMatmul, h, d, alpha, A, Ad, B, Bd, beta, C, Cd, D, Dd, algo, workspace, workspace_bytes,
                  stream);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t d,
                                                           cublasLtMatrixLayout_t Ad, cublasLtMatrixLayout_t Bd,
                                                           cublasLtMatrixLayout_t Cd, cublasLtMatrixLayout_t Dd,
                                                           cublasLtMatmulPreference_t pref, int requested,
                                                           cublasLtMatmulHeuristicResult_t results[],
                                                           int* returned) {
  COLIBRI_LT_CALL(cublasLtMatmulAlgoGetHeuristic, h, d, Ad, Bd, Cd, Dd, pref, requested, results, returned);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t compute,
                                                     cudaDataType_t scale) {
  COLIBRI_LT_CALL(cublasLtMatmulDescCreate, d, compute, scale);
}
cublasStatus_t CUBLASWINAPI cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  COLIBRI_LT_CALL(cublasLtMatmulDescDestroy, d);
}
cublasStatus_t CUBLASWINAPI cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a,
                                                           const void* buf, size_t size) {
  COLIBRI_LT_CALL(cublasLtMatmulDescSetAttribute, d, a, buf, size);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) {
  COLIBRI_LT_CALL(cublasLtMatmulPreferenceCreate, p);
}
cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  COLIBRI_LT_CALL(cublasLtMatmulPreferenceDestroy, p);
}
cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                                 cublasLtMatmulPreferenceAttributes_t a,
                                                                 const void* buf, size_t size) {
  COLIBRI_LT_CALL(cublasLtMatmulPreferenceSetAttribute, p, a, buf, size);
}

cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType type, uint64_t rows,
                                                       uint64_t cols, int64_t ld) {
  COLIBRI_LT_CALL(cublasLtMatrixLayoutCreate, l, type, rows, cols, ld);
}
cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  COLIBRI_LT_CALL(cublasLtMatrixLayoutDestroy, l);
}
cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l,
                                                             cublasLtMatrixLayoutAttribute_t a, const void* buf,
                                                             size_t size) {
  COLIBRI_LT_CALL(cublasLtMatrixLayoutSetAttribute, l, a, buf, size);
}

}  // extern "C"
