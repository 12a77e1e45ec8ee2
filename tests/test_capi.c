/* test_capi.c: the public C API from plain C. Converts a transformers fixture
 * with the colibri command, loads it through colibri_init, and checks that
 * colibri_generate reproduces the fixture's greedy tokens, that colibri_infer's
 * next token agrees, that the callback sees every token and can cancel, and that
 * bad input gives the right status and a message instead of a crash. Then text:
 * a synthetic model with the qwen2_bpe tokenizer fixture converted in, where
 * colibri_encode gives the fixture's ids, colibri_decode inverts it (with size
 * queries), and colibri_generate_text streams what colibri_generate's tokens
 * decode to, ends at a stop string, and a model without a tokenizer says so.
 * usage: test_capi FIXTURES_DIR COLIBRI_EXE */
#ifndef _DEFAULT_SOURCE
#define _DEFAULT_SOURCE /* mkdtemp */
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "colibri.h"

static int failures = 0;
#define CHECK(cond, ...)                                             \
  do {                                                               \
    if (!(cond)) {                                                   \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                  \
      fprintf(stderr, "\n");                                         \
      ++failures;                                                    \
    }                                                                \
  } while (0)

/* Reads the nested integer list after "key": in a JSON file: [[a, b], [c]]. */
static int read_lists(const char* text, const char* key, int32_t out[][64], int32_t* lens, int max_lists) {
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\"", key);
  const char* p = strstr(text, pat);
  if (!p) return -1;
  p = strchr(p, '[');
  if (!p) return -1;
  ++p; /* into the outer list */
  int n = 0, depth = 1;
  while (*p && depth > 0) {
    if (*p == '[') {
      if (n >= max_lists) return -1;
      lens[n] = 0;
      ++depth;
      ++p;
      while (*p && *p != ']') {
        if ((*p >= '0' && *p <= '9') || *p == '-') {
          char* end;
          long v = strtol(p, &end, 10);
          if (lens[n] < 64) out[n][lens[n]++] = (int32_t)v;
          p = end;
        } else {
          ++p;
        }
      }
      ++n;
      --depth;
    } else if (*p == ']') {
      --depth;
    }
    ++p;
  }
  return n;
}

struct cb_state {
  int calls;
  int stop_after;
};

static int on_token(void* user, int32_t seq, int32_t pos, int32_t tok) {
  struct cb_state* s = (struct cb_state*)user;
  (void)seq;
  (void)pos;
  (void)tok;
  ++s->calls;
  return s->stop_after > 0 && s->calls >= s->stop_after;
}

static int valid_utf8(const char* s, size_t n) {
  size_t i = 0;
  while (i < n) {
    unsigned char c = (unsigned char)s[i];
    size_t k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (k == 0 || i + k > n) return 0;
    for (size_t j = 1; j < k; ++j)
      if ((((unsigned char)s[i + j]) >> 6) != 2) return 0;
    i += k;
  }
  return 1;
}

/* Text streaming: every piece of sequence 0 appended to `text`. */
struct text_cb {
  char text[8192];
  size_t len;
  int calls;
  char reason[32];
};
static int on_text(void* user, int32_t seq, const char* text, size_t length, const char* finish_reason) {
  struct text_cb* t = (struct text_cb*)user;
  ++t->calls;
  if (seq != 0) return 0;
  if (t->len + length < sizeof t->text) {
    memcpy(t->text + t->len, text, length);
    t->len += length;
    t->text[t->len] = 0;
  }
  if (finish_reason) snprintf(t->reason, sizeof t->reason, "%s", finish_reason);
  return 0;
}

/* The text API on a synthetic qwen3_moe model with the qwen2_bpe tokenizer. */
static void check_text(const char* fixtures, const char* exe, colibri_model* no_tokenizer) {
  char dir[] = "/tmp/colibri-capi-text.XXXXXX";
  if (!mkdtemp(dir)) {
    CHECK(0, "mkdtemp failed");
    return;
  }
  char cmd[4096], model[512];
  snprintf(model, sizeof model, "%s/m.colibri", dir);
  snprintf(cmd, sizeof cmd,
           "'%s' synth --arch qwen3_moe --preset tiny --out '%s/hf' --log-level warn && "
           "cp '%s/tokenizers/qwen2_bpe/tokenizer.json' '%s/tokenizers/qwen2_bpe/tokenizer_config.json' '%s/hf/' && "
           "'%s' convert '%s/hf' '%s' --log-level warn",
           exe, dir, fixtures, fixtures, dir, exe, dir, model);
  CHECK(system(cmd) == 0, "synth + convert with a tokenizer failed: %s", cmd);
  colibri_model* m = NULL;
  colibri_status st = colibri_init(model, NULL, &m);
  CHECK(st == COLIBRI_OK, "init: %s", colibri_last_error());
  if (st == COLIBRI_OK) {
    /* tests/fixtures/tokenizers/qwen2_bpe/expected.json, "Hello, world!". */
    const int32_t want[10] = {0, 42, 71, 302, 81, 14, 359, 78, 70, 3};
    int32_t ids[64];
    size_t n = 0;
    CHECK(colibri_encode(m, "Hello, world!", 1, NULL, 0, &n) == COLIBRI_OK && n == 10, "size query: %zu", n);
    CHECK(colibri_encode(m, "Hello, world!", 1, ids, 4, &n) == COLIBRI_ERR_INVALID_ARGUMENT && n == 10,
          "a small buffer must fail and report 10");
    CHECK(colibri_encode(m, "Hello, world!", 1, ids, 64, &n) == COLIBRI_OK && n == 10, "encode: %s", colibri_last_error());
    CHECK(memcmp(ids, want, sizeof want) == 0, "ids differ from transformers'");
    CHECK(colibri_encode(m, "Hello, world!", 0, ids, 64, &n) == COLIBRI_OK && n == 9 && ids[0] == 42, "no special");
    char buf[256];
    size_t len = 0;
    CHECK(colibri_decode(m, want, 10, 0, NULL, 0, &len) == COLIBRI_OK && len == strlen("<|endoftext|>Hello, world!"),
          "decode size query: %zu", len);
    CHECK(colibri_decode(m, want, 10, 0, buf, len, &len) == COLIBRI_ERR_INVALID_ARGUMENT, "no room for the NUL");
    CHECK(colibri_decode(m, want, 10, 1, buf, sizeof buf, &len) == COLIBRI_OK && strcmp(buf, "Hello, world!") == 0,
          "decode skip_special: '%s'", buf);
    int32_t bad_id = 100000;
    CHECK(colibri_decode(m, &bad_id, 1, 1, buf, sizeof buf, &len) == COLIBRI_ERR_INVALID_ARGUMENT, "bad id accepted");

    /* generate_text streams decode(generate's tokens); the ids past the
     * tokenizer's 480 (the model has 512) stand for no text. */
    colibri_sampling s = colibri_default_sampling();
    s.max_new_tokens = 24;
    s.ignore_eos = 1;
    const int32_t* pp[1] = {want};
    int32_t pl[1] = {10}, toks[24], count = 0;
    CHECK(colibri_generate(m, pp, pl, 1, &s, NULL, NULL, toks, &count) == COLIBRI_OK && count == 24, "generate");
    int32_t known[24];
    int nk = 0;
    for (int i = 0; i < count; ++i)
      if (toks[i] < 480) known[nk++] = toks[i];
    static char dec[8192];
    CHECK(colibri_decode(m, known, (size_t)nk, 1, dec, sizeof dec, &len) == COLIBRI_OK, "decode generated");
    const char* prompts[2] = {"Hello, world!", "Привет"};
    struct text_cb tc;
    memset(&tc, 0, sizeof tc);
    int32_t counts[2];
    st = colibri_generate_text(m, prompts, 2, 1, &s, NULL, 0, on_text, &tc, counts);
    CHECK(st == COLIBRI_OK, "generate_text: %s", colibri_last_error());
    CHECK(counts[0] == 24 && counts[1] == 24, "counts %d %d", counts[0], counts[1]);
    CHECK(strcmp(tc.reason, "length") == 0, "finish reason '%s'", tc.reason);
    CHECK(valid_utf8(tc.text, tc.len), "streamed text is not valid UTF-8");
    if (valid_utf8(dec, len)) /* decode() of a cut character is not UTF-8; the stream's is */
      CHECK(strcmp(tc.text, dec) == 0, "streamed '%s' != decoded '%s'", tc.text, dec);
    /* A stop string: the text before it, finish reason "stop". */
    if (tc.len > 6) {
      char stop[4] = {0};
      size_t k = tc.len / 2;
      while (k < tc.len && (((unsigned char)tc.text[k]) & 0xC0) == 0x80) ++k;
      if (k < tc.len && ((unsigned char)tc.text[k]) < 0x80 && tc.text[k] != 0) {
        stop[0] = tc.text[k];
        const char* first = strstr(tc.text, stop);
        size_t before = (size_t)(first - tc.text);
        char want_text[8192];
        memcpy(want_text, tc.text, before);
        want_text[before] = 0;
        const char* stops[1] = {stop};
        struct text_cb t2;
        memset(&t2, 0, sizeof t2);
        st = colibri_generate_text(m, prompts, 1, 1, &s, stops, 1, on_text, &t2, NULL);
        CHECK(st == COLIBRI_OK, "generate_text with stop: %s", colibri_last_error());
        CHECK(strcmp(t2.reason, "stop") == 0, "finish reason with stop '%s'", t2.reason);
        CHECK(strcmp(t2.text, want_text) == 0, "stop '%s': '%s' != '%s'", stop, t2.text, want_text);
      }
    }
    colibri_free(m);
  }
  /* No tokenizer: a clear error. */
  size_t n2 = 0;
  CHECK(colibri_encode(no_tokenizer, "hi", 1, NULL, 0, &n2) == COLIBRI_ERR_INVALID_ARGUMENT, "encode without a tokenizer");
  CHECK(strstr(colibri_last_error(), "no embedded tokenizer") != NULL, "message: %s", colibri_last_error());
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  CHECK(system(cmd) == 0, "cleanup");
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s FIXTURES_DIR COLIBRI_EXE\n", argv[0]);
    return 2;
  }
  char path[4096], cmd[8192], model[4096];
  snprintf(path, sizeof path, "%s/mixtral_a/expected.json", argv[1]);
  FILE* f = fopen(path, "rb");
  CHECK(f != NULL, "cannot open %s", path);
  if (!f) return 1;
  static char text[1 << 20];
  size_t n = fread(text, 1, sizeof text - 1, f);
  text[n] = 0;
  fclose(f);
  int32_t prompts[8][64], greedy[8][64], plen[8], glen[8];
  int np = read_lists(text, "prompts", prompts, plen, 8);
  int ng = read_lists(text, "greedy_tokens", greedy, glen, 8);
  CHECK(np >= 2 && np == ng, "fixture lists: %d prompts, %d greedy", np, ng);
  if (np < 2 || np != ng) return 1;

  snprintf(model, sizeof model, "/tmp/colibri-capi-%d.colibri", (int)getpid());
  snprintf(cmd, sizeof cmd, "'%s' convert '%s/mixtral_a/hf' '%s' --dtype f32 --log-level warn", argv[2], argv[1], model);
  CHECK(system(cmd) == 0, "convert failed: %s", cmd);

  /* Bad input: a missing file, NULL arguments. */
  colibri_model* m = NULL;
  colibri_config cfg = colibri_default_config();
  colibri_status st = colibri_init("/nonexistent/model.colibri", &cfg, &m);
  CHECK(st == COLIBRI_ERR_IO && m == NULL, "missing file gave %s", colibri_status_string(st));
  CHECK(strstr(colibri_last_error(), "/nonexistent/model.colibri") != NULL, "message: %s", colibri_last_error());
  CHECK(colibri_init(NULL, &cfg, &m) == COLIBRI_ERR_INVALID_ARGUMENT, "NULL path accepted");
  /* A file that is not a model. */
  st = colibri_init(argv[0], &cfg, &m);
  CHECK(st == COLIBRI_ERR_FORMAT, "executable as model gave %s", colibri_status_string(st));

  st = colibri_init(model, &cfg, &m);
  CHECK(st == COLIBRI_OK, "init: %s: %s", colibri_status_string(st), colibri_last_error());
  if (st != COLIBRI_OK) return 1;
  colibri_model_info info;
  CHECK(colibri_get_info(m, &info) == COLIBRI_OK, "get_info");
  CHECK(info.vocab_size == 160 && info.num_experts == 4 && info.experts_per_token == 2, "info: vocab %d experts %d",
        info.vocab_size, info.num_experts);

  const int32_t* ptrs[8];
  for (int i = 0; i < np; ++i) ptrs[i] = prompts[i];
  colibri_sampling s = colibri_default_sampling();
  s.max_new_tokens = glen[0];
  s.ignore_eos = 1;
  int32_t* toks = calloc((size_t)np * s.max_new_tokens, sizeof(int32_t));
  int32_t counts[8];
  struct cb_state cb = {0, 0};
  st = colibri_generate(m, ptrs, plen, np, &s, on_token, &cb, toks, counts);
  CHECK(st == COLIBRI_OK, "generate: %s: %s", colibri_status_string(st), colibri_last_error());
  CHECK(cb.calls == np * s.max_new_tokens, "callback calls %d", cb.calls);
  for (int i = 0; i < np; ++i) {
    CHECK(counts[i] == glen[i], "sequence %d: %d tokens", i, counts[i]);
    for (int j = 0; j < glen[i]; ++j)
      CHECK(toks[i * s.max_new_tokens + j] == greedy[i][j], "sequence %d token %d: %d, transformers %d", i, j,
            toks[i * s.max_new_tokens + j], greedy[i][j]);
  }

  /* colibri_infer: next token = first greedy token; logits finite. */
  float* logits = malloc(sizeof(float) * (size_t)np * info.vocab_size);
  int32_t next[8];
  st = colibri_infer(m, ptrs, plen, np, logits, next);
  CHECK(st == COLIBRI_OK, "infer: %s", colibri_last_error());
  for (int i = 0; i < np; ++i) {
    CHECK(next[i] == greedy[i][0], "infer next token %d vs %d", next[i], greedy[i][0]);
    for (int v = 0; v < info.vocab_size; ++v) CHECK(logits[i * info.vocab_size + v] == logits[i * info.vocab_size + v], "NaN logit");
  }

  /* Cancellation keeps the tokens so far. */
  cb.calls = 0;
  cb.stop_after = 3;
  st = colibri_generate(m, ptrs, plen, np, &s, on_token, &cb, toks, counts);
  CHECK(st == COLIBRI_ERR_CANCELLED, "cancel gave %s", colibri_status_string(st));
  CHECK(cb.calls == 3, "callback calls after cancel: %d", cb.calls);

  /* Out-of-range token id: a clear error, and the model still works after it. */
  int32_t bad[2] = {3, 100000};
  const int32_t* bp[1] = {bad};
  int32_t bl[1] = {2};
  st = colibri_generate(m, bp, bl, 1, &s, NULL, NULL, NULL, NULL);
  CHECK(st == COLIBRI_ERR_INVALID_ARGUMENT, "bad token gave %s", colibri_status_string(st));
  CHECK(strstr(colibri_last_error(), "100000") != NULL, "message: %s", colibri_last_error());
  s.top_p = 2.0f;
  CHECK(colibri_generate(m, ptrs, plen, 1, &s, NULL, NULL, NULL, NULL) == COLIBRI_ERR_INVALID_ARGUMENT, "top_p 2 accepted");
  s.top_p = 1.0f;
  CHECK(colibri_generate(m, ptrs, plen, 1, &s, NULL, NULL, toks, counts) == COLIBRI_OK, "generate after errors");
  CHECK(toks[0] == greedy[0][0], "first token after errors");
  CHECK(strcmp(colibri_status_string(COLIBRI_ERR_CHECKSUM), "checksum mismatch") == 0, "status string");

  check_text(argv[1], argv[2], m);

  colibri_free(m);
  colibri_free(NULL);
  free(toks);
  free(logits);
  unlink(model);
  if (failures) {
    fprintf(stderr, "%d checks failed\n", failures);
    return 1;
  }
  printf("C API: all checks passed (%d sequences, %d tokens each)\n", np, s.max_new_tokens);
  return 0;
}
