// chat_template.h: Hugging Face chat templates, rendered as transformers'
// apply_chat_template(tokenize=False) renders them: the subset of Jinja2 that
// chat templates use (docs/chat_templates.md), with the environment transformers
// compiles them in (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
// loopcontrols, its own tojson, raise_exception and strftime_now).
//
// Values are nlohmann::ordered_json: a template that prints a tool's JSON schema
// (tojson, items()) prints its keys in the order the request gave them, as Python
// dicts do; nlohmann::json would sort them.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace colibri {

namespace jinja {
struct Program;
}

struct ChatTemplateOptions {
  // strftime_now() formats this time (seconds since the epoch, in UTC) instead
  // of the local clock, so that a render is reproducible (tests, fixtures).
  std::optional<int64_t> fixed_time;
  // Limits that keep a hostile template or request from exhausting the process:
  // every string or list the template builds and the output itself, nested macro
  // calls, and the statements, loop iterations and calls executed in one render.
  size_t max_output_bytes = size_t{32} << 20;
  int max_call_depth = 64;
  int64_t max_steps = 20'000'000;
};

class ChatTemplate {
 public:
  // Parses `source`. Throws Error(Format) for a malformed template and
  // Error(Unsupported) for Jinja outside the subset, each naming line:column.
  explicit ChatTemplate(std::string source);

  // Renders with `context` (an object: the template's variables). Throws
  // Error(InvalidArgument) when the template fails on this input (an undefined
  // value used, a type error, raise_exception(msg): then `msg` exactly) or a
  // limit of `options` is reached.
  std::string render(const nlohmann::ordered_json& context, const ChatTemplateOptions& options = {}) const;

  const std::string& source() const { return source_; }

 private:
  std::string source_;
  std::shared_ptr<const jinja::Program> program_;
};

// transformers' apply_chat_template(messages, tokenize=False, ...): the context
// is messages, tools and documents (null unless `extra` sets them),
// add_generation_prompt, bos_token and eos_token (left undefined when empty, as
// for a tokenizer without one), then `extra`'s keys (other special tokens such as
// pad_token, and template kwargs such as enable_thinking or reasoning_effort),
// which override the others.
std::string apply_chat_template(const ChatTemplate& tmpl, const nlohmann::ordered_json& messages,
                                bool add_generation_prompt, const std::string& bos_token,
                                const std::string& eos_token, const nlohmann::ordered_json& extra = nullptr,
                                const ChatTemplateOptions& options = {});

}  // namespace colibri
