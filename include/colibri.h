/* colibri.h: the public C API of the Colibri Mixture-of-Experts inference engine.
 * Plain C, no CUDA or MPI types. Every function returns a status; nothing in the
 * library calls exit(). Handles are opaque.
 *
 * Threads: a handle may be shared by threads. Calls on one handle that use its
 * engine or tokenizer (colibri_infer, colibri_generate, colibri_generate_text,
 * colibri_encode, colibri_decode) are serialised: a call waits until the
 * handle's previous call returns, and each gets exactly the result it would
 * get alone. colibri_get_info never waits. Different handles run
 * concurrently. A callback runs while its call holds the handle: a call on
 * that same handle from inside the callback returns
 * COLIBRI_ERR_INVALID_ARGUMENT at once (it would otherwise wait for itself);
 * calls on other handles are allowed. colibri_free while another thread still
 * uses the handle is the caller's bug. colibri_last_error is per thread.
 * n_threads (colibri_config) applies to the handle's calls on every thread. */
#ifndef COLIBRI_H
#define COLIBRI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define COLIBRI_API __declspec(dllexport)
#else
#define COLIBRI_API __attribute__((visibility("default")))
#endif

typedef enum colibri_status {
  COLIBRI_OK = 0,
  COLIBRI_ERR_INVALID_ARGUMENT = 1, /* a parameter or request is out of range */
  COLIBRI_ERR_IO = 2,               /* a file could not be opened, read or written */
  COLIBRI_ERR_FORMAT = 3,           /* a model file or checkpoint is malformed */
  COLIBRI_ERR_CHECKSUM = 4,         /* stored data does not match its checksum */
  COLIBRI_ERR_UNSUPPORTED = 5,      /* architecture, dtype or feature not supported */
  COLIBRI_ERR_OUT_OF_MEMORY = 6,    /* an allocation or a memory budget failed */
  COLIBRI_ERR_COMM = 7,             /* a communicator call failed or a rank was lost */
  COLIBRI_ERR_CANCELLED = 8,        /* stopped by the caller (callback returned non-zero) */
  COLIBRI_ERR_INTERNAL = 9,         /* a bug: please report it */
  COLIBRI_ERR_NUMERICAL = 10,       /* numerical failure: a forward pass gave NaN, infinite or
                                       degenerate (all equal) logits, the model's weights or config
                                       overflow; the tokens generated before it are kept */
  COLIBRI_ERR_FILE_CHANGED = 11     /* the model file was truncated or rewritten while in use; the
                                       handle is unusable: free it and open the file again */
} colibri_status;

/* Engine configuration; get defaults from colibri_default_config(). */
typedef struct colibri_config {
  int32_t n_threads;     /* compute threads, 0..1024; 0 = all cores */
  int32_t max_batch;     /* most sequences per call */
  int32_t max_context;   /* most positions per sequence (prompt + generated); 0 = the model's
                            maximum, capped at 4096 */
  int32_t prefill_chunk; /* most tokens per prefill forward pass */
  int32_t log_level;     /* 0 trace .. 6 off; 3 (warn) by default */
} colibri_config;

/* Sampling parameters; get defaults from colibri_default_sampling(). */
typedef struct colibri_sampling {
  float temperature;      /* 0 = greedy (argmax) */
  int32_t top_k;          /* keep the k most likely tokens; 0 = off */
  float top_p;            /* nucleus: smallest set with probability >= top_p; 1 = off */
  uint64_t seed;          /* sequence i samples with seed + i */
  int32_t max_new_tokens; /* tokens to generate per sequence */
  int32_t ignore_eos;     /* non-zero: do not stop at the end-of-sequence token */
} colibri_sampling;

/* What the loaded model is. */
typedef struct colibri_model_info {
  int32_t vocab_size;
  int32_t hidden_size;
  int32_t num_layers;
  int32_t num_experts;
  int32_t experts_per_token;
  int32_t max_context;
  int32_t eos_token_id; /* -1 when the model has none */
} colibri_model_info;

typedef struct colibri_model colibri_model;

/* Called once per generated token. Return non-zero to stop the whole call
 * (it then returns COLIBRI_ERR_CANCELLED, with the tokens so far kept). */
typedef int (*colibri_token_callback)(void* user_data, int32_t sequence, int32_t position,
                                      int32_t token);

COLIBRI_API colibri_config colibri_default_config(void);
COLIBRI_API colibri_sampling colibri_default_sampling(void);

/* Opens and validates a .colibri file. On failure *model is NULL. */
COLIBRI_API colibri_status colibri_init(const char* path, const colibri_config* config,
                                        colibri_model** model);

COLIBRI_API colibri_status colibri_get_info(const colibri_model* model,
                                            colibri_model_info* info);

/* Runs each prompt and returns the logits of its last position.
 * prompts[i] has lengths[i] token ids; logits: [n_sequences][vocab_size] or NULL;
 * next_tokens: [n_sequences] greedy argmax or NULL. */
COLIBRI_API colibri_status colibri_infer(colibri_model* model, const int32_t* const* prompts,
                                         const int32_t* lengths, int32_t n_sequences,
                                         float* logits, int32_t* next_tokens);

/* Generates up to sampling->max_new_tokens per prompt. When the call fails
 * after generation started (COLIBRI_ERR_NUMERICAL, COLIBRI_ERR_FILE_CHANGED...),
 * out_tokens and out_counts still hold the tokens generated before the failure.
 * out_tokens: [n_sequences][max_new_tokens] (or NULL); out_counts: [n_sequences] (or NULL).
 * callback may be NULL. */
COLIBRI_API colibri_status colibri_generate(colibri_model* model, const int32_t* const* prompts,
                                            const int32_t* lengths, int32_t n_sequences,
                                            const colibri_sampling* sampling,
                                            colibri_token_callback callback, void* user_data,
                                            int32_t* out_tokens, int32_t* out_counts);

/* ---- Text, through the tokenizer embedded in the model file (docs/tokenizer.md).
 * A model converted without one answers COLIBRI_ERR_INVALID_ARGUMENT.
 * Buffers: the count needed is always stored (*n_ids, *length); when the buffer
 * is too small nothing is written and the call fails with
 * COLIBRI_ERR_INVALID_ARGUMENT, except for a size query (NULL buffer and
 * capacity 0), which returns COLIBRI_OK. */

/* UTF-8 text (NUL-terminated) -> token ids. add_special non-zero: add the
 * tokens the tokenizer adds around a sequence (BOS...), as transformers'
 * add_special_tokens=True. */
COLIBRI_API colibri_status colibri_encode(colibri_model* model, const char* text, int32_t add_special,
                                          int32_t* ids, size_t capacity, size_t* n_ids);

/* Token ids -> text, NUL-terminated in buf (capacity must hold *length + 1
 * bytes). skip_special non-zero: leave out special tokens (BOS, EOS...). An
 * id range that cuts a UTF-8 character yields its bytes as they are. */
COLIBRI_API colibri_status colibri_decode(colibri_model* model, const int32_t* ids, size_t n_ids,
                                          int32_t skip_special, char* buf, size_t capacity,
                                          size_t* length);

/* Called with each sequence's text as it is generated: `text` (`length` bytes,
 * valid UTF-8, NUL-terminated) is the new text since the last call, and
 * finish_reason is NULL until the sequence's last call, where it is "eos",
 * "stop" (a stop string appeared; neither it nor what follows is passed),
 * "length", "cancelled", "interrupted" or "error" (the call then fails with
 * the error's status, e.g. COLIBRI_ERR_NUMERICAL or COLIBRI_ERR_FILE_CHANGED). Return non-zero to stop the whole
 * call (it then returns COLIBRI_ERR_CANCELLED). */
typedef int (*colibri_text_callback)(void* user_data, int32_t sequence, const char* text, size_t length,
                                     const char* finish_reason);

/* Encodes each prompt (UTF-8, NUL-terminated; add_special as colibri_encode),
 * generates up to sampling->max_new_tokens per sequence, stopping at the
 * model's end-of-sequence ids (unless ignore_eos) and at any of the n_stop
 * stop strings, and streams the text (special tokens skipped) to callback
 * (which may be NULL). out_counts: [n_sequences] tokens generated (or NULL). */
COLIBRI_API colibri_status colibri_generate_text(colibri_model* model, const char* const* prompts,
                                                 int32_t n_sequences, int32_t add_special,
                                                 const colibri_sampling* sampling,
                                                 const char* const* stop, int32_t n_stop,
                                                 colibri_text_callback callback, void* user_data,
                                                 int32_t* out_counts);

/* ---- Requests (continuous batching, docs/batching.md): token prompts submitted
 * at any time, from any thread, run together by the handle's request thread
 * (started by the first colibri_submit); each joins the running set at the
 * next step and leaves it when it ends, and gets exactly the tokens it would
 * get alone (colibri_generate of it). While submitted requests are unfinished,
 * the blocking calls (colibri_infer, colibri_generate, colibri_generate_text)
 * on that handle fail with COLIBRI_ERR_INVALID_ARGUMENT: they would share its
 * KV cache; use a second handle. */

/* Called on the request thread after each new token of a request (`token`,
 * finish_reason NULL), and once when it ends (token -1, finish_reason "eos",
 * "stop", "length", "cancelled" or "error"). It may call colibri_submit,
 * colibri_poll, colibri_cancel and colibri_release, not the blocking calls. */
typedef void (*colibri_request_callback)(void* user_data, int64_t request, int32_t token,
                                         const char* finish_reason);

/* Queues a request: prompt[length] ids, sampling (NULL: defaults; the seed is
 * used as given), callback (may be NULL). *request gets its id (ids count from
 * 0 per handle). The prompt is checked now (ids, length, context); a request
 * the KV cache cannot hold ends with finish_reason "error". */
COLIBRI_API colibri_status colibri_submit(colibri_model* model, const int32_t* prompt, int32_t length,
                                          const colibri_sampling* sampling,
                                          colibri_request_callback callback, void* user_data,
                                          int64_t* request);

/* A request's tokens so far (as colibri_encode's buffers: the count needed is
 * always stored in *n_tokens; a buffer too small fails unless it is a size
 * query), and *finish_reason: NULL while it runs, else the reason it ended
 * (a static string). */
COLIBRI_API colibri_status colibri_poll(colibri_model* model, int64_t request, int32_t* tokens,
                                        size_t capacity, size_t* n_tokens, const char** finish_reason);

/* Ends a request at the next step (finish_reason "cancelled"; its KV blocks
 * are freed then). A finished request: no-op. */
COLIBRI_API colibri_status colibri_cancel(colibri_model* model, int64_t request);

/* Forgets a finished request (its tokens); an unfinished one is
 * COLIBRI_ERR_INVALID_ARGUMENT. Unknown ids are COLIBRI_ERR_INVALID_ARGUMENT. */
COLIBRI_API colibri_status colibri_release(colibri_model* model, int64_t request);

/* Cancels every unfinished request, stops the request thread, frees the handle. */
COLIBRI_API void colibri_free(colibri_model* model);

/* A short fixed description of a status. */
COLIBRI_API const char* colibri_status_string(colibri_status status);

/* The detailed message of the last failed call on this thread ("" if none). */
COLIBRI_API const char* colibri_last_error(void);

#ifdef __cplusplus
}
#endif
#endif /* COLIBRI_H */
