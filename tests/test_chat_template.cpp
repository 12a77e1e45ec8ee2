// test_chat_template.cpp: chat templates (model/chat_template.h): the eight
// families' real templates against transformers' output
// (tests/fixtures/chat_templates/cases.json, scripts/make_chat_fixtures.py), the
// Jinja subset feature by feature (every EXPECT_CT_RENDER expectation is what
// jinja2 3.1 renders in transformers' environment), the errors, the limits, random
// garbage, and the chat template a converted checkpoint carries.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "model/chat_template.h"
#include "model/colibri_file.h"
#include "model/config.h"
#include "model/converter.h"
#include "model/error.h"
#include "model/synth.h"
#include "test_util.h"

namespace colibri {
namespace {

using ojson = nlohmann::ordered_json;
using test::expect_error;
namespace fs = std::filesystem;

constexpr int64_t kCtFixedTime = 1736937000;  // 2025-01-15 10:30:00 UTC, as scripts/make_chat_fixtures.py

std::string ct_fixture_dir() { return test::fixtures_dir() + "/chat_templates"; }

std::string ct_slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string ct_render(const std::string& tmpl, const std::string& ctx = "{}", ChatTemplateOptions o = {}) {
  if (!o.fixed_time) o.fixed_time = kCtFixedTime;
  return ChatTemplate(tmpl).render(ojson::parse(ctx), o);
}

#define EXPECT_CT_RENDER(tmpl, ctx, want)                  \
  do {                                                  \
    SCOPED_TRACE(std::string("template: ") + (tmpl));  \
    try {                                               \
      EXPECT_EQ(ct_render(tmpl, ctx), want);               \
    } catch (const Error& e) {                          \
      ADD_FAILURE() << "threw: " << e.what();           \
    }                                                   \
  } while (0)

// ---- the eight families' real templates, byte for byte ----

TEST(ChatTemplateFixtures, EveryFamilyMatchesTransformers) {
  const ojson cases = ojson::parse(ct_slurp(ct_fixture_dir() + "/cases.json"));
  const int64_t fixed = cases["fixed_time"].get<int64_t>();
  ASSERT_EQ(fixed, kCtFixedTime);
  std::set<std::string> families;
  size_t rendered = 0, raised = 0;
  for (const auto& c : cases["cases"]) {
    const std::string family = c["family"].get<std::string>();
    SCOPED_TRACE(family + "/" + c["name"].get<std::string>());
    families.insert(family);
    const ChatTemplate tmpl(ct_slurp(ct_fixture_dir() + "/" + family + ".jinja"));
    ojson extra = ojson::object();
    std::string bos, eos;
    for (const auto& [k, v] : c["special_tokens"].items()) {
      if (k == "bos_token") bos = v.get<std::string>();
      else if (k == "eos_token") eos = v.get<std::string>();
      else extra[k] = v;
    }
    for (const auto& [k, v] : c["kwargs"].items()) extra[k] = v;
    ChatTemplateOptions o;
    o.fixed_time = fixed;
    if (c.contains("error")) {
      ++raised;
      expect_error([&] { apply_chat_template(tmpl, c["messages"], c["add_generation_prompt"].get<bool>(), bos, eos, extra, o); },
                   Status::InvalidArgument, {c["error"].get<std::string>()});
      continue;
    }
    ++rendered;
    std::string got;
    ASSERT_NO_THROW(got = apply_chat_template(tmpl, c["messages"], c["add_generation_prompt"].get<bool>(), bos, eos, extra, o));
    EXPECT_EQ(got, c["expected"].get<std::string>());
  }
  EXPECT_EQ(families.size(), 8u);
  EXPECT_GE(rendered, 50u);
  EXPECT_GE(raised, 3u);
}

TEST(ChatTemplateFixtures, RaiseExceptionMessageIsTheTemplates) {
  const ChatTemplate mixtral(ct_slurp(ct_fixture_dir() + "/mixtral.jinja"));
  const ojson msgs = ojson::parse(R"([{"role":"user","content":"a"},{"role":"user","content":"b"}])");
  try {
    apply_chat_template(mixtral, msgs, true, "<s>", "</s>");
    FAIL() << "did not raise";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::InvalidArgument);
    EXPECT_STREQ(e.what(), "Conversation roles must alternate user/assistant/user/assistant/...");
  }
}

TEST(ChatTemplateFixtures, ApplyChatTemplateContext) {
  // transformers passes tools and documents as None, the special tokens it has,
  // and the kwargs last (they win).
  const ChatTemplate t(
      "{{ tools is none }}|{{ documents is none }}|{{ bos_token is defined }}|{{ eos_token }}|"
      "{{ add_generation_prompt }}|{{ messages|length }}|{{ pad_token }}|{{ flag }}");
  const ojson msgs = ojson::parse(R"([{"role":"user","content":"hi"}])");
  EXPECT_EQ(apply_chat_template(t, msgs, true, "", "</s>", ojson{{"pad_token", "<pad>"}, {"flag", 1}}),
            "True|True|False|</s>|True|1|<pad>|1");
  EXPECT_EQ(apply_chat_template(t, msgs, false, "<s>", "</s>", ojson{{"eos_token", "E"}, {"tools", ojson::array()}}),
            "False|True|True|E|False|1||");
  expect_error([&] { apply_chat_template(t, msgs, true, "", "", ojson::array()); }, Status::InvalidArgument,
               {"not an object"});
}

// ---- the language ----

TEST(ChatTemplate, LiteralsPrintAsPython) {
  EXPECT_CT_RENDER("{{ 1 }}|{{ -1 }}|{{ 1.0 }}|{{ 1e16 }}|{{ 1.5e-5 }}|{{ 0.1+0.2 }}|{{ 3/2 }}|{{ 7//2 }}|{{ -7//2 }}", "{}",
                "1|-1|1.0|1e+16|1.5e-05|0.30000000000000004|1.5|3|-4");
  EXPECT_CT_RENDER("{{ 7%3 }}|{{ -7%3 }}|{{ 2**10 }}|{{ 2**-1 }}|{{ 7.5//2 }}|{{ -7.5%2 }}", "{}", "1|2|1024|0.5|3.0|0.5");
  EXPECT_CT_RENDER("{{ 'a' ~ 1 ~ none ~ true }}|{{ none }}|{{ True }}|{{ false }}", "{}", "a1NoneTrue|None|True|False");
  EXPECT_CT_RENDER("{{ [1, 'a', none, true, 1.5] }}|{{ {'a': 1, 'b': [2]} }}", "{}",
                "[1, 'a', None, True, 1.5]|{'a': 1, 'b': [2]}");
  EXPECT_CT_RENDER("{{ \"it's\" }}|{{ ['it\\'s', 'a\"b', \"x'\\\"y\"] }}", "{}", "it's|[\"it's\", 'a\"b', 'x\\'\"y']");
  EXPECT_CT_RENDER("{{ ['\\n\\t\\\\', '\\x01\\x7f', '\xc3\xa9', '\\u00a0', '\\u200b'] }}", "{}",
                "['\\n\\t\\\\', '\\x01\\x7f', '\xc3\xa9', '\\xa0', '\\u200b']");
  EXPECT_CT_RENDER("{{ 'a' 'b' \"c\" }}|{{ '\\101\\x41\\u0041\\U0001F600' }}|{{ '\\q' }}", "{}",
                "abc|AAA\xf0\x9f\x98\x80|\\q");
  EXPECT_CT_RENDER("{{ 0x1F }}|{{ 0o17 }}|{{ 0b101 }}|{{ 1_000 }}|{{ 1_0.5 }}|{{ 1e3 }}|{{ 2E-2 }}", "{}",
                "31|15|5|1000|10.5|1000.0|0.02");
  EXPECT_CT_RENDER("{{ x }}", R"({"x": {"z": 1, "a": [1.5, 1e20, -0.0, 3]}})", "{'z': 1, 'a': [1.5, 1e+20, -0.0, 3]}");
  EXPECT_CT_RENDER("{{ (1, 2)|length }}{{ [1, 2,] }}{{ {'a': 1,} }}", "{}", "2[1, 2]{'a': 1}");
}

TEST(ChatTemplate, WhitespaceControl) {
  // trim_blocks eats the newline after a block tag, lstrip_blocks the indentation before it.
  EXPECT_CT_RENDER("a\n  {% if true %}\n    x\n  {% endif %}\n  b\n", "{}", "a\n    x\n  b");
  EXPECT_CT_RENDER("{{ 'x' }}  {% if true %} y {% endif %}", "{}", "x   y ");  // not at a line start
  EXPECT_CT_RENDER("  {%- if true -%}  x  {%- endif -%}  ", "{}", "x");
  EXPECT_CT_RENDER("a {{- ' b ' -}} c\n{{ 'd' }}\n", "{}", "a b c\nd");
  EXPECT_CT_RENDER("{# comment #}\nx\n  {# indented comment #}\ny{#- strip -#}  z\n", "{}", "x\nyz");
  EXPECT_CT_RENDER("{% raw %}{{ not rendered }}{% endraw %}\n{%- raw -%}  {% x %}  {%- endraw %}", "{}",
                "{{ not rendered }}{% x %}");
  EXPECT_CT_RENDER("line1\n    {%+ if true %}kept{% endif %}\n{% if true +%}\nnl{% endif %}", "{}",
                "line1\n    kept\nnl");
  EXPECT_CT_RENDER("{% for x in [1,2] %}\n  {{ x }}\n{% endfor %}\n", "{}", "  1\n  2\n");
  EXPECT_CT_RENDER("\t{% if true %}\ttab\n{% endif %}", "{}", "\ttab\n");
  EXPECT_CT_RENDER("a\r\nb\r{{ 'c' }}\r\n", "{}", "a\nb\nc");  // newlines normalised, one trailing dropped
  EXPECT_CT_RENDER("x\n\n", "{}", "x\n");
  EXPECT_CT_RENDER("{{ x }}}|{{ {'a': 1}}}", R"({"x": 1})", "1}|{'a': 1}");  // braces balance inside a tag
}

TEST(ChatTemplate, UndefinedIsJinjasDefault) {
  // Falsy, prints as nothing, iterates as nothing; using it otherwise is an error.
  EXPECT_CT_RENDER("{{ u ~ 'x' }}|{{ u | default('d') }}|{{ u | length }}|{{ u is none }}|{{ u is defined }}", "{}",
                "x|d|0|False|False");
  EXPECT_CT_RENDER("{{ u is iterable }}|{{ u is sequence }}|{{ u is string }}|{{ not u }}|{% for x in u %}X{% else %}e{% endfor %}",
                "{}", "True|True|False|True|e");
  EXPECT_CT_RENDER("{{ 'a' in u }}|{{ u == u }}|{{ u != none }}|{{ u|trim }}|{{ u|string }}|{{ u|list }}|{{ u|first }}|{{ u|last }}",
                "{}", "False|True|True|||[]||");
  EXPECT_CT_RENDER("{{ d.missing }}|{{ d.missing is defined }}|{{ d['missing'] is defined }}|{{ l[5] }}|{{ x if false }}",
                R"({"d": {}, "l": [1]})", "|False|False||");
  for (const char* use : {"{{ u + 1 }}", "{{ u.x }}", "{{ u[0] }}", "{{ u < 1 }}", "{{ u|tojson }}", "{{ d.a.b }}"})
    expect_error([&] { ct_render(use, R"({"d": {}})"); }, Status::InvalidArgument, {"line 1:"});
}

TEST(ChatTemplate, AttributesItemsAndSlices) {
  EXPECT_CT_RENDER("{{ d.a }}|{{ d['a'] }}|{{ d['items'] }}|{{ d.items is defined }}", R"({"d": {"a": 1, "items": 5}})",
                "1|1|5|True");  // the sandbox prefers dict methods for `.`, keys for []
  EXPECT_CT_RENDER("{{ l[0] }}|{{ l[-1] }}|{{ l.0 }}|{{ l[1:3] }}|{{ l[::2] }}|{{ l[-2:] }}|{{ l[:-1] }}|{{ l[::-2] }}",
                R"({"l": [1, 2, 3, 4]})", "1|4|1|[2, 3]|[1, 3]|[3, 4]|[1, 2, 3]|[4, 2]");
  EXPECT_CT_RENDER("{{ s[0] }}|{{ s[-1] }}|{{ s[1:] }}|{{ s[::-1] }}|{{ s[10:] }}|{{ s[-100:2] }}",
                "{\"s\": \"h\xc3\xa9llo\"}", "h|o|\xc3\xa9llo|oll\xc3\xa9h||h\xc3\xa9");
  EXPECT_CT_RENDER("{{ {'a': {'b': 1}}['a']['b'] }}|{{ messages[0]['role'] }}|{{ messages[-1].content }}",
                R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})",
                "1|user|yo");
}

TEST(ChatTemplate, Operators) {
  EXPECT_CT_RENDER("{% for v in vals %}{{ 'T' if v else 'F' }}{% endfor %}",
                R"({"vals": [0, 1, 0.0, 0.5, "", "a", [], [0], {}, {"a": 1}, null, true, false, -1]})",
                "FTFTFTFTFTFTFT");
  EXPECT_CT_RENDER("{{ 1 == 1.0 }}{{ true == 1 }}{{ '1' == 1 }}{{ [1,2] == [1,2] }}{{ {'a':1,'b':2} == {'b':2,'a':1} }}"
                "{{ none == none }}{{ 1 != 2 }}{{ [1] == [1.0] }}",
                "{}", "TrueTrueFalseTrueTrueTrueTrueTrue");
  EXPECT_CT_RENDER("{{ 1 < 2 }}{{ 'a' < 'b' }}{{ [1,2] < [1,3] }}{{ [1] < [1,0] }}{{ 2 >= 2.0 }}{{ 1 < 2 < 3 }}{{ 3 > 2 > 2 }}",
                "{}", "TrueTrueTrueTrueTrueTrueFalse");
  EXPECT_CT_RENDER("{{ 'a' in 'cat' }}{{ 'x' in ['x'] }}{{ 'k' in {'k':1} }}{{ 1 in [1.0] }}{{ 'z' not in 'abc' }}{{ 2 not in [1,2] }}",
                "{}", "TrueTrueTrueTrueTrueFalse");
  EXPECT_CT_RENDER("{{ a and b }}|{{ a or b }}|{{ c or b }}|{{ c and b }}|{{ not c }}|{{ not a and c }}|{{ a if c else b }}",
                R"({"a": "A", "b": "B", "c": ""})", "B|A|B||True|False|B");
  EXPECT_CT_RENDER("{{ 'x' * 3 }}{{ 3 * 'y' }}{{ [1] * 2 }}{{ 'a' * -1 }}{{ [1] + [2] }}{{ 'a' + 'b' }}{{ 1 + 2.5 }}{{ true + true }}",
                "{}", "xxxyyy[1, 1][1, 2]ab3.52");
  EXPECT_CT_RENDER("{{ -(-3) }}{{ +4 }}{{ - 2.5 }}|{{ 'a' if true else 'b' if false else 'c' }}|{{ -l[0]|abs }}",
                R"({"l": [3]})", "34-2.5|a|3");
  EXPECT_CT_RENDER("{{ not x is defined }}|{{ x is not defined }}|{{ (l|first) + 1 }}|{{ l|length > 1 }}",
                R"({"l": [3, 4]})", "True|True|4|True");
  expect_error([] { ct_render("{{ 'a' + 1 }}"); }, Status::InvalidArgument, {"line 1:4", "'str' and 'int'"});
  expect_error([] { ct_render("{{ 1 < 'a' }}"); }, Status::InvalidArgument, {"not supported between"});
  expect_error([] { ct_render("{{ 1 in 'abc' }}"); }, Status::InvalidArgument, {"requires string"});
  expect_error([] { ct_render("{{ 1 / 0 }}"); }, Status::InvalidArgument, {"division by zero"});
  expect_error([] { ct_render("{{ 1 // 0 }}"); }, Status::InvalidArgument, {"division"});
}

TEST(ChatTemplate, Filters) {
  EXPECT_CT_RENDER("{{ ' a b '|trim }}|{{ 'xxaxx'|trim('x') }}|{{ 'abc'|upper }}|{{ 'ABC'|lower }}|{{ 'hello world'|capitalize }}",
                "{}", "a b|a|ABC|abc|Hello world");
  EXPECT_CT_RENDER("{{ 'hELLo wORLD'|title }}|{{ \"it's-a (test) [x] <y>\"|title }}|{{ [1,2,3]|length }}|{{ 'h\xc3\xa9llo'|length }}|{{ {'a':1}|count }}",
                "{}", "Hello World|It's-A (Test) [X] <Y>|3|5|1");
  EXPECT_CT_RENDER("{{ [1,2,3]|join(', ') }}|{{ [1,2]|join }}|{{ [{'a':'x'},{'a':'y'}]|join('-', attribute='a') }}|{{ 'abc'|join('.') }}",
                "{}", "1, 2, 3|12|x-y|a.b.c");
  EXPECT_CT_RENDER("{{ [1,2,3]|first }}|{{ [1,2,3]|last }}|{{ 'abc'|first }}|{{ 'abc'|last }}|{{ []|first }}|{{ {'k':1,'j':2}|first }}",
                "{}", "1|3|a|c||k");
  EXPECT_CT_RENDER("{{ 'a-b-a'|replace('a','X') }}|{{ 'aaa'|replace('a','b',2) }}|{{ 'ab'|replace('','-') }}|{{ 'abc'|list }}",
                "{}", "X-b-X|bba|-a-b-|['a', 'b', 'c']");
  EXPECT_CT_RENDER("{{ {'a':1,'b':2}|list }}|{{ [3,1,2]|reverse|list }}|{{ 'abc'|reverse }}|{{ [3,1,2]|sort }}|{{ ['b','A','a']|sort }}",
                "{}", "['a', 'b']|[2, 1, 3]|cba|[1, 2, 3]|['A', 'a', 'b']");
  EXPECT_CT_RENDER("{{ [3,1,2]|sort(reverse=true) }}|{{ [{'n':2},{'n':1}]|sort(attribute='n') }}|{{ {'a':1}|items|list|length }}",
                "{}", "[3, 2, 1]|[{'n': 1}, {'n': 2}]|1");
  EXPECT_CT_RENDER("{{ '42'|int }}|{{ ' 42 '|int }}|{{ '4.7'|int }}|{{ 'x'|int }}|{{ 'x'|int(7) }}|{{ 3.9|int }}|{{ -3.9|int }}",
                "{}", "42|42|4|0|7|3|-3");
  EXPECT_CT_RENDER("{{ true|int }}|{{ none|int }}|{{ '0x1A'|int(0, 16) }}|{{ '1A'|int(base=16) }}|{{ '1_000'|int }}",
                "{}", "1|0|26|26|1000");
  EXPECT_CT_RENDER("{{ '3'|float }}|{{ 'x'|float }}|{{ 2|float }}|{{ '1e3'|float }}", "{}", "3.0|0.0|2.0|1000.0");
  EXPECT_CT_RENDER("{{ x|default('d') }}|{{ ''|default('d') }}|{{ ''|default('d', true) }}|{{ none|default('d') }}|"
                "{{ none|d('d', boolean=true) }}|{{ 0|default(5) }}",
                "{}", "d||d|None|d|0");
  EXPECT_CT_RENDER("{{ 'a<b>&\"\\''|e }}|{{ 1|string }}|{{ [1]|string }}|{{ 1|safe }}|{{ -3|abs }}|{{ -2.5|abs }}", "{}",
                "a&lt;b&gt;&amp;&#34;&#39;|1|[1]|1|3|2.5");
  EXPECT_CT_RENDER("{{ 'a\\nb\\n\\nc'|indent }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\n\\nb'|indent(width='>', blank=true) }}",
                "{}", "a\n    b\n\n    c|  a\n  b|a\n>\n>b");
}

TEST(ChatTemplate, ToJsonIsTransformers) {
  // json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  // no HTML escaping, Python's separators, keys in the request's order.
  EXPECT_CT_RENDER("{{ {'b':1,'a':[1,2.5,'\xc3\xa9\"\\n',none,true]}|tojson }}", "{}",
                "{\"b\": 1, \"a\": [1, 2.5, \"\xc3\xa9\\\"\\n\", null, true]}");
  EXPECT_CT_RENDER("{{ {'b':1}|tojson(indent=2) }}|{{ [1,[2,{}],[]]|tojson(indent=2) }}", "{}",
                "{\n  \"b\": 1\n}|[\n  1,\n  [\n    2,\n    {}\n  ],\n  []\n]");
  EXPECT_CT_RENDER("{{ '\xc3\xa9'|tojson(ensure_ascii=true) }}|{{ {'b':1,'a':2}|tojson(sort_keys=true) }}|{{ [1,2]|tojson(separators=[',',':']) }}",
                "{}", "\"\\u00e9\"|{\"a\": 2, \"b\": 1}|[1,2]");
  EXPECT_CT_RENDER("{{ '<&>'|tojson }}|{{ 1.0|tojson }}|{{ '\xf0\x9f\x98\x80'|tojson(true) }}|{{ {'a':1}|tojson(indent='\\t') }}",
                "{}", "\"<&>\"|1.0|\"\\ud83d\\ude00\"|{\n\t\"a\": 1\n}");
  EXPECT_CT_RENDER("{{ tool|tojson }}", R"({"tool": {"name": "f", "parameters": {"z": 1, "a": 2}}})",
                "{\"name\": \"f\", \"parameters\": {\"z\": 1, \"a\": 2}}");
}

TEST(ChatTemplate, SelectMapAndFriends) {
  EXPECT_CT_RENDER("{{ [{'r':'u','c':1},{'r':'s','c':2},{'c':3}]|selectattr('r')|list }}|"
                "{{ [{'r':'u'},{'r':'s'}]|selectattr('r','equalto','u')|list }}|{{ [{'r':'u'},{'r':'s'}]|rejectattr('r','eq','u')|list }}",
                "{}", "[{'r': 'u', 'c': 1}, {'r': 's', 'c': 2}]|[{'r': 'u'}]|[{'r': 's'}]");
  EXPECT_CT_RENDER("{{ [{'a':1},{'b':2}]|selectattr('a','defined')|list }}|{{ [{'a':1},{'b':2}]|rejectattr('a','undefined')|list }}|"
                "{{ [1,2,3,4]|select('odd')|list }}|{{ [1,2,3,4]|reject('even')|list }}|{{ [0,1,'',None,'a']|select|list }}",
                "{}", "[{'a': 1}]|[{'a': 1}]|[1, 3]|[1, 3]|[1, 'a']");
  EXPECT_CT_RENDER("{{ [{'a':{'b':1}},{'a':{'b':2}}]|map(attribute='a.b')|list }}|{{ ['a','b']|map('upper')|list }}|"
                "{{ [[1,2],[3]]|map('length')|list }}|{{ [{'a':1},{}]|map(attribute='a', default=0)|list }}|"
                "{{ [[1,2],[3,4]]|map(attribute='0')|list }}|{{ [' a ']|map('trim')|join }}",
                "{}", "[1, 2]|['A', 'B']|[2, 1]|[1, 0]|[1, 3]|a");
  EXPECT_CT_RENDER("{{ messages|selectattr('role','equalto','user')|list|length }}",
                R"({"messages": [{"role":"user"},{"role":"assistant"},{"role":"user"}]})", "2");
}

TEST(ChatTemplate, Tests) {
  EXPECT_CT_RENDER("{{ 1 is number }}{{ true is number }}{{ 1.5 is float }}{{ 1 is integer }}{{ true is integer }}{{ 'a' is string }}"
                "{{ {} is mapping }}{{ [] is mapping }}{{ [] is iterable }}{{ 'a' is iterable }}{{ 1 is iterable }}{{ {} is sequence }}",
                "{}", "TrueTrueTrueTrueFalseTrueTrueFalseTrueTrueFalseTrue");
  EXPECT_CT_RENDER("{{ none is none }}{{ true is true }}{{ 1 is true }}{{ false is false }}{{ true is boolean }}{{ 1 is boolean }}",
                "{}", "TrueTrueFalseTrueTrueFalse");
  EXPECT_CT_RENDER("{{ 4 is divisibleby 2 }}{{ 4 is divisibleby(3) }}{{ 3 is odd }}{{ 4 is even }}{{ 'ab' is lower }}{{ 'Ab' is upper }}"
                "{{ 'AB' is upper }}{{ '1' is lower }}{{ 2 is eq 2 }}{{ 2 is ne 3 }}{{ 3 is gt 2 }}{{ 3 is ge 3 }}{{ 1 is lt 2 }}"
                "{{ 1 is le 0 }}{{ 'a' is in 'abc' }}{{ none is sameas none }}",
                "{}", "TrueFalseTrueTrueTrueFalseTrueFalseTrueTrueTrueTrueTrueFalseTrueTrue");
}

TEST(ChatTemplate, ForLoops) {
  EXPECT_CT_RENDER("{% for x in [1,2,3] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}"
                "{{ loop.last }}{{ loop.length }}|{{ loop.previtem }}|{{ loop.nextitem }};{% endfor %}",
                "{}", "1032TrueFalse3||2;2121FalseFalse3|1|3;3210FalseTrue3|2|;");
  EXPECT_CT_RENDER("{% for x in [1,2,3,4] if x is even %}{{ x }}{{ loop.index }}/{{ loop.length }} {% endfor %}", "{}",
                "21/2 42/2 ");
  EXPECT_CT_RENDER("{% for x in [] %}a{% else %}none{% endfor %}|{% for x in [1] if false %}a{% else %}filtered{% endfor %}",
                "{}", "none|filtered");
  EXPECT_CT_RENDER("{% for k, v in {'a':1,'b':2}.items() %}{{ k }}={{ v }};{% endfor %}|{% for k in {'a':1,'b':2} %}{{ k }}{% endfor %}|"
                "{% for c in 'h\xc3\xa9j' %}[{{ c }}]{% endfor %}|{% for a, b in [[1,2],[3,4]] %}{{ a+b }}{% endfor %}",
                "{}", "a=1;b=2;|ab|[h][\xc3\xa9][j]|37");
  EXPECT_CT_RENDER("{% for x in [1,2,3,4,5] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}",
                "{}", "13");
  EXPECT_CT_RENDER("{% for x in [1,2] %}{% for y in 'ab' %}{{ x }}{{ y }}{{ loop.index }}{% endfor %}{{ loop.index }}{% endfor %}", "{}",
                "1a11b212a12b22");
  EXPECT_CT_RENDER("{% for x in [1,2,3] %}{{ loop.cycle('o','e') }}{% endfor %}|{% for i in range(2) %}{{ i }}{% endfor %}|"
                "{{ range(1,4)|list }}{{ range(5,0,-2)|list }}",
                "{}", "oeo|01|[1, 2, 3][5, 3, 1]");
  // A fresh scope per iteration: a set does not carry to the next iteration nor out.
  EXPECT_CT_RENDER("{% set c = 'a' %}{% for m in [1,2,3] %}{{ c }}{% set c = m %}{{ c }}{% endfor %}|{{ c }}", "{}",
                "a1a2a3|a");
  EXPECT_CT_RENDER("{% for m in [1,2,3] %}{% if m > 1 %}{{ c }}{% endif %}{% set c = m %}{% endfor %}", "{}", "");
  expect_error([] { ct_render("{% for a, b in [[1, 2, 3]] %}{% endfor %}"); }, Status::InvalidArgument, {"unpack"});
  expect_error([] { ct_render("{% for x in 5 %}{% endfor %}"); }, Status::InvalidArgument, {"not iterable"});
}

TEST(ChatTemplate, SetNamespaceMacroAndBlocks) {
  EXPECT_CT_RENDER("{% set x = 1 %}{% set y, z = [2, 3] %}{{ x }}{{ y }}{{ z }}{% if true %}{% set q = 5 %}{% endif %}{{ q }}", "{}",
                "1235");
  EXPECT_CT_RENDER("{% set ns = namespace(a=1, b='x') %}{% for i in [1,2,3] %}{% set ns.a = ns.a + i %}{% endfor %}{{ ns.a }}{{ ns.b }}"
                "{{ ns.c }}|{{ ns }}",
                "{}", "7x|<Namespace {'a': 7, 'b': 'x'}>");
  EXPECT_CT_RENDER("{% set ns = namespace() %}{% set ns.items = [1] %}{{ ns.items }}", "{}", "[1]");
  EXPECT_CT_RENDER("{% set s %}hello {{ 'world' }}{% endset %}[{{ s }}]{% set t | upper %}abc{% endset %}{{ t }}", "{}",
                "[hello world]ABC");
  EXPECT_CT_RENDER("{% filter upper %}abc{{ 'd' }}{% endfilter %}", "{}", "ABCD");
  EXPECT_CT_RENDER("{% macro m(a, b='B', c=none) %}[{{ a }}{{ b }}{{ c }}]{% endmacro %}{{ m(1) }}{{ m(1, 2) }}{{ m(a=3, c=4) }}{{ m() }}",
                "{}", "[1BNone][12None][3B4][BNone]");
  EXPECT_CT_RENDER("{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(5) }}", "{}", "54321");
  EXPECT_CT_RENDER("{% set y = 1 %}{% macro f() %}{{ y }}{% endmacro %}{% set y = 2 %}{{ f() }}", "{}", "2");
  const char* scoped = "{% macro f() %}{% if x is not defined %}{% set x = 'd' %}{% endif %}{{ x }}{% endmacro %}{{ f() }}";
  EXPECT_CT_RENDER(scoped, R"({"x": "ctx"})", "ctx");
  EXPECT_CT_RENDER(scoped, "{}", "d");
  EXPECT_CT_RENDER("{% macro f(x) %}{{ x }}{% endmacro %}{% set r = f('a') %}{{ r ~ r }}{{ f('bc')|length }}", "{}", "aa2");
  EXPECT_CT_RENDER("{% generation %}gen{{ 1 }}{% endgeneration %}|{% print 'p', 2 %}", "{}", "gen1|p2");
  EXPECT_CT_RENDER("{{ dict(a=1, b='x') }}|{{ strftime_now('%Y-%m-%d %H:%M %b %d %A') }}", "{}",
                "{'a': 1, 'b': 'x'}|2025-01-15 10:30 Jan 15 Wednesday");
  expect_error([] { ct_render("{% set x = 5 %}{% set x.a = 1 %}"); }, Status::InvalidArgument, {"non-namespace"});
  expect_error([] { ct_render("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}"); }, Status::InvalidArgument, {"takes not more"});
}

TEST(ChatTemplate, StringAndDictMethods) {
  EXPECT_CT_RENDER("{{ ' a b '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ '  a'.lstrip() }}|{{ 'a  '.rstrip() }}|{{ 'a\\n'.rstrip('\\n') }}",
                "{}", "a b|a|a|a|a");
  EXPECT_CT_RENDER("{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a b c'.split(' ', 1) }}|{{ 'a b c'.rsplit(' ', 1) }}|"
                "{{ ' a b c '.split(none, 1) }}|{{ ' a b c '.rsplit(none, 1) }}|{{ 'x</think>y</think>z'.split('</think>')[-1] }}",
                "{}", "['a', 'b', '', 'c']|['a', 'b']|['a', 'b c']|['a b', 'c']|['a', 'b c ']|[' a b', 'c']|z");
  EXPECT_CT_RENDER("{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith('bc') }}{{ 'abc'.startswith(('x','a')) }}{{ 'abc'.upper() }}"
                "{{ 'ABC'.lower() }}{{ 'hello world'.title() }}{{ \"it's 1st\".title() }}{{ 'hELLO'.capitalize() }}",
                "{}", "TrueTrueTrueABCabcHello WorldIt'S 1StHello");
  EXPECT_CT_RENDER("{{ 'aXa'.replace('a','b') }}{{ 'abcb'.find('b') }}{{ 'abcb'.rfind('b') }}{{ 'abcb'.find('z') }}{{ 'abcb'.count('b') }}"
                "{{ '-'.join(['a','b']) }}{{ 'a\\nb\\r\\nc'.splitlines() }}",
                "{}", "bXb13-12a-b['a', 'b', 'c']");
  EXPECT_CT_RENDER("{{ d.get('a') }}{{ d.get('z') }}{{ d.get('z', 5) }}{{ d.keys()|list }}{{ d.values()|list }}",
                R"({"d": {"a": 1, "b": [2]}})", "1None5['a', 'b'][1, [2]]");
  EXPECT_CT_RENDER("{{ '\xc3\x89'.lower() }}{{ '\xc3\xa9'.upper() }}{{ 'stra\xc3\x9f\x65'.upper() }}{{ '\xc5\x82\xc3\xb3\x64\xc5\xba'.upper() }}",
                "{}", "\xc3\xa9\xc3\x89STRASSE\xc5\x81\xc3\x93\x44\xc5\xb9");
}

// ---- errors ----

TEST(ChatTemplate, UnsupportedIsRefusedAtParseTimeWithLineColumn) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"x\n  {% include 'a' %}", {"line 2:6", "include"}},
      {"{% extends 'a' %}", {"line 1:4", "extends"}},
      {"{% call m() %}{% endcall %}", {"line 1:4", "call"}},
      {"{% with a = 1 %}{% endwith %}", {"with"}},
      {"{% do x %}", {"do"}},
      {"{{ x|wordwrap }}", {"line 1:6", "wordwrap"}},
      {"{{ x is escaped }}", {"escaped"}},
      {"{{ x.format(1) }}", {"format()"}},
      {"{{ lipsum() }}", {"lipsum"}},
      {"{{ nosuchfunction() }}", {"nosuchfunction"}},
      {"{% for x in y recursive %}{% endfor %}", {"recursive"}},
      {"{{ x[1, 2] }}", {"tuple"}},
      {"{{ f(*a) }}", {"*args"}},
      {"{{ 99999999999999999999 }}", {"64 bits"}},
      {"{{ '\\N{BULLET}' }}", {"\\N"}},
      {"{{ caller() }}", {"caller"}},
      {"{{ loop.changed(x) }}", {"changed()"}},
      {"{{ \xc3\xa9 }}", {"non-ASCII"}},
  };
  for (const auto& kase : cases) {
    const std::string& t = kase.first;  // NOTE: not a structured binding: Clang 14 cannot capture those
    SCOPED_TRACE(t);
    expect_error([&] { ChatTemplate c(t); }, Status::Unsupported, kase.second);
  }
  // Found only when rendering: Python would, the subset does not.
  expect_error([] { ct_render("{{ '%s' % 1 }}"); }, Status::Unsupported, {"formatting"});
  expect_error([] { ct_render("{{ {1: 2} }}"); }, Status::Unsupported, {"dict keys"});
  expect_error([] { ct_render("{{ 9223372036854775807 + 1 }}"); }, Status::Unsupported, {"64 bits"});
  expect_error([] { ct_render("{{ d.items }}", R"({"d": {}})"); }, Status::Unsupported, {"printing a method"});
}

TEST(ChatTemplate, MalformedIsFormatWithLineColumn) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"{{ x ", {"line 1:6", "'}}'"}},
      {"{% if x %}a", {"end of template", "endif"}},
      {"ok\n{% for %}", {"line 2:8"}},
      {"{% endif %}", {"unknown tag 'endif'"}},
      {"{% foo %}", {"unknown tag 'foo'"}},
      {"{{ x|nosuch }}", {"no filter named 'nosuch'"}},
      {"{{ x is nosuch }}", {"no test named"}},
      {"{{ 'abc }}", {"unterminated"}},
      {"{# unclosed", {"comment"}},
      {"{% raw %}x", {"endraw"}},
      {"{% break %}", {"outside a for loop"}},
      {"{% for x in l %}{% else %}{% break %}{% endfor %}", {"outside a for loop"}},
      {"{{ x $ y }}", {"line 1:6", "'$'"}},
      {"{{ ) }}", {"unexpected ')'"}},
      {"{{ 'a' ~ }}", {"unexpected"}},
      {"{% macro m(a=1, b) %}{% endmacro %}", {"default"}},
      {"{% if x %}{% else %}{% else %}{% endif %}", {"unknown tag 'else'"}},
      {"{{}}", {"expected an expression"}},
      {"{{ '\\u12' }}", {"truncated"}},
      {"{{ (1 }}", {"expected ')'"}},
  };
  for (const auto& kase : cases) {
    const std::string& t = kase.first;
    SCOPED_TRACE(t);
    expect_error([&] { ChatTemplate c(t); }, Status::Format, kase.second);
  }
}

TEST(ChatTemplate, RaiseException) {
  try {
    ct_render("{% if messages|length > 1 %}{{ raise_exception('Only one message, got ' ~ messages|length) }}{% endif %}",
           R"({"messages": [1, 2]})");
    FAIL() << "did not raise";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::InvalidArgument);
    EXPECT_STREQ(e.what(), "Only one message, got 2");
  }
}

// ---- limits: never a crash, never a hang ----

TEST(ChatTemplate, LimitsStopRunawayTemplates) {
  expect_error([] { ct_render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"); }, Status::InvalidArgument,
               {"nest deeper"});
  ChatTemplateOptions small;
  small.max_output_bytes = 1000;
  expect_error([&] { ct_render("{% for i in range(1000) %}xx{% endfor %}", "{}", small); }, Status::InvalidArgument,
               {"max_output_bytes"});
  expect_error([&] { ct_render("{{ 'x' * 2000 }}", "{}", small); }, Status::InvalidArgument, {"max_output_bytes"});
  expect_error([] { ct_render("{% set ns = namespace(s='ab') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"); },
               Status::InvalidArgument, {"max_output_bytes"});
  ChatTemplateOptions few;
  few.max_steps = 10000;
  expect_error([&] { ct_render("{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}", "{}", few); },
               Status::InvalidArgument, {"max_steps"});
  expect_error([] { ct_render("{{ range(10000000)|length }}"); }, Status::InvalidArgument, {"range()"});
  expect_error([] { ct_render("{{ ([1] * 9223372036854775807)|length }}"); }, Status::InvalidArgument, {"max_output_bytes"});
  // A recursive macro multiplies the source's nesting; the renderer bounds its own recursion.
  std::string nested = "{% macro f(n) %}";
  for (int i = 0; i < 100; ++i) nested += "{% if true %}";
  nested += "{% if n > 0 %}{{ f(n - 1) }}{% endif %}";
  for (int i = 0; i < 100; ++i) nested += "{% endif %}";
  expect_error([&] { ct_render(nested + "{% endmacro %}{{ f(60) }}"); }, Status::InvalidArgument,
               {"nests too deeply while rendering"});
  EXPECT_EQ(ct_render(nested + "{% endmacro %}{{ f(3) }}"), "");
  // Nesting: of the source (parser) and of the values the request brings.
  expect_error([] { ChatTemplate c("{{ " + std::string(500, '(') + "1" + std::string(500, ')') + " }}"); }, Status::Format,
               {"nest"});
  std::string chain = "{{ 1";
  for (int i = 0; i < 5000; ++i) chain += " + 1";
  expect_error([&] { ChatTemplate c(chain + " }}"); }, Status::Format, {"nests too deeply"});
  std::string elifs = "{% if a %}";
  for (int i = 0; i < 1000; ++i) elifs += "{% elif a %}";
  expect_error([&] { ChatTemplate c(elifs + "{% endif %}"); }, Status::Format, {"elif"});
  std::string deep = "1";
  for (int i = 0; i < 2000; ++i) deep = "[" + deep + "]";
  const ojson ctx = ojson::parse("{\"x\": " + deep + "}");
  for (const char* use : {"{{ x }}", "{{ x|tojson }}", "{{ x == x }}"})
    expect_error([&] { ChatTemplate(use).render(ctx); }, Status::InvalidArgument, {"nests too deeply"});
}

// Random garbage: parsing and rendering either succeed or throw colibri::Error.
TEST(ChatTemplate, RandomGarbageNeverCrashes) {
  const uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  const std::vector<std::string> pieces = {
      "{{", "}}", "{%", "%}", "{#", "#}", "{%-", "-%}", "{{-", "-}}", "if ", "for ", " in ", "endif", "endfor", "else",
      "set ", "macro ", "endmacro", "x", "messages", "loop.index", "ns", "namespace(", "(", ")", "[", "]", "{", "}", "'",
      "\"", "|", "tojson", "trim", "length", ".", ",", ":", "=", "==", "+", "-", "*", "/", "%", "~", " ", "\n", "1",
      "0.5", "none", "true", "not ", " and ", " or ", " is ", "defined", "raise_exception(", "\\", "\xc3\xa9", "\xff",
      "range(", "99", "[::-1]", "break", "continue", "raw", "endraw", "filter ", "endfilter", "items()", "selectattr("};
  const ojson ctx = ojson::parse(R"({"x": [1, "a", {"b": null}], "messages": [{"role": "user", "content": "hi"}]})");
  ChatTemplateOptions o;
  o.fixed_time = kCtFixedTime;
  o.max_steps = 100000;
  o.max_output_bytes = 1 << 20;
  size_t parsed = 0;
  for (int iter = 0; iter < 1500; ++iter) {  // a new seed every run (printed): coverage accumulates across runs
    std::string t;
    const int n = static_cast<int>(rng() % 30);
    for (int i = 0; i < n; ++i) {
      if (rng() % 8 == 0) t += static_cast<char>(rng() % 256);
      else t += pieces[rng() % pieces.size()];
    }
    try {
      ChatTemplate c(t);
      ++parsed;
      (void)c.render(ctx, o);
    } catch (const Error&) {
    }
  }
  // Mutations of a real template exercise deeper paths than random pieces.
  const std::string base = ct_slurp(ct_fixture_dir() + "/qwen3_moe.jinja");
  const ojson msgs = ojson::parse(R"({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
      {"role": "assistant", "content": "<think>r</think>a", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
      {"role": "tool", "content": "t"}], "tools": [{"type": "function"}], "add_generation_prompt": true})");
  for (int iter = 0; iter < 1500; ++iter) {
    std::string t = base;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t at = rng() % t.size();
      switch (rng() % 3) {
        case 0: t.erase(at, 1 + rng() % 8); break;
        case 1: t.insert(at, pieces[rng() % pieces.size()]); break;
        default: t[at] = static_cast<char>(rng() % 128); break;
      }
    }
    try {
      ChatTemplate c(t);
      ++parsed;
      (void)c.render(msgs, o);
    } catch (const Error&) {
    }
  }
  EXPECT_GT(parsed, 50u) << "the generator should produce some valid templates";
}

// ---- the checkpoint's chat template, through convert ----

class ChatTemplateConvert : public ::testing::Test {
 protected:
  void SetUp() override {
    tok_ = test::fixtures_dir() + "/tokenizers/qwen2_bpe";
    if (!fs::exists(tok_ + "/tokenizer.json")) GTEST_SKIP() << "no qwen2_bpe tokenizer fixture";
    SynthOptions so;
    so.arch = "qwen3_moe";
    so.preset = "tiny";
    synthesize_model(dir_.file("hf"), so);
    fs::copy_file(tok_ + "/tokenizer.json", dir_.file("hf/tokenizer.json"));
  }

  void write_config(const nlohmann::json& tc) { std::ofstream(dir_.file("hf/tokenizer_config.json")) << tc.dump(); }

  std::shared_ptr<ColibriFile> convert() {
    const std::string out = dir_.file("m.colibri");
    fs::remove(out);
    convert_checkpoint(dir_.file("hf"), out, ConvertOptions{});
    return ColibriFile::open(out);
  }

  test::TempDir dir_;
  std::string tok_;
};

TEST_F(ChatTemplateConvert, TokenizerConfigTemplateRoundTrips) {
  const std::string qwen3 = ct_slurp(ct_fixture_dir() + "/qwen3_moe.jinja");
  nlohmann::json tc = nlohmann::json::parse(ct_slurp(tok_ + "/tokenizer_config.json"));
  tc["chat_template"] = qwen3;
  tc["pad_token"] = {{"content", "<|endoftext|>"}, {"__type", "AddedToken"}};
  write_config(tc);
  auto file = convert();
  ASSERT_TRUE(file->has_tokenizer());
  EXPECT_EQ(file->chat_template(), qwen3);
  const TokenizerSpec& spec = file->config().tokenizer;
  EXPECT_EQ(spec.special_token("bos_token"), "<|endoftext|>");
  EXPECT_EQ(spec.special_token("eos_token"), "<|im_end|>");
  EXPECT_EQ(spec.special_token("pad_token"), "<|endoftext|>");
  EXPECT_EQ(spec.special_token("unk_token"), "");
  const ChatTemplate t(file->chat_template());
  EXPECT_EQ(apply_chat_template(t, ojson::parse(R"([{"role":"user","content":"hi"}])"), true,
                                spec.special_token("bos_token"), spec.special_token("eos_token")),
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  // The config JSON round-trips, and validates.
  const ModelConfig again = ModelConfig::from_json(file->config().to_json());
  EXPECT_EQ(again.tokenizer.chat_template, qwen3);
  EXPECT_EQ(again.tokenizer.special_tokens, spec.special_tokens);
}

TEST_F(ChatTemplateConvert, ListUsesDefaultAndJinjaFileWins) {
  nlohmann::json tc = nlohmann::json::parse(ct_slurp(tok_ + "/tokenizer_config.json"));
  tc["chat_template"] = nlohmann::json::array({{{"name", "tool_use"}, {"template", "TOOLS"}},
                                               {{"name", "default"}, {"template", "{{ 'DEFAULT' }}"}}});
  write_config(tc);
  EXPECT_EQ(convert()->chat_template(), "{{ 'DEFAULT' }}");
  std::ofstream(dir_.file("hf/chat_template.jinja")) << "{{ 'FILE' }}";
  EXPECT_EQ(convert()->chat_template(), "{{ 'FILE' }}");
  fs::remove(dir_.file("hf/chat_template.jinja"));
  tc["chat_template"] = nlohmann::json::array({{{"name", "tool_use"}, {"template", "TOOLS"}}});
  write_config(tc);
  EXPECT_EQ(convert()->chat_template(), "") << "no default: none kept (transformers would refuse to choose)";
  tc["chat_template"] = 5;
  write_config(tc);
  expect_error([&] { convert(); }, Status::Format, {"chat_template"});
}

TEST_F(ChatTemplateConvert, NoTemplateLeavesTheConfigAsBefore) {
  nlohmann::json tc = nlohmann::json::parse(ct_slurp(tok_ + "/tokenizer_config.json"));
  tc.erase("bos_token");
  tc.erase("eos_token");
  write_config(tc);
  auto file = convert();
  EXPECT_EQ(file->chat_template(), "");
  const nlohmann::json j = file->config().to_json();
  EXPECT_FALSE(j["tokenizer"].contains("chat_template"));
  EXPECT_FALSE(j["tokenizer"].contains("special_tokens"));
}

TEST_F(ChatTemplateConvert, UnsupportedTemplateIsKept) {
  nlohmann::json tc = nlohmann::json::parse(ct_slurp(tok_ + "/tokenizer_config.json"));
  tc["chat_template"] = "{% include 'x' %}";
  write_config(tc);
  auto file = convert();
  EXPECT_EQ(file->chat_template(), "{% include 'x' %}");
  expect_error([&] { ChatTemplate t(file->chat_template()); }, Status::Unsupported, {"include"});
}

TEST(ChatTemplateConfig, ValidateChecksTheTemplateFields) {
  ModelConfig c = ModelConfig::from_json(ModelConfig::from_hf(nlohmann::json::parse(
      R"({"model_type": "mixtral", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
          "num_local_experts": 4, "num_experts_per_tok": 2})")).to_json());
  c.tokenizer.chat_template = "{{ x }}";
  expect_error([&] { c.validate(); }, Status::Format, {"without tokenizer.kind"});
  c.tokenizer.kind = "hf_json";
  c.tokenizer.vocab_size = 64;
  c.tokenizer.special_tokens = {{"bos_token", "<s>"}};
  EXPECT_NO_THROW(c.validate());
  c.tokenizer.special_tokens = {{"what_token", "<s>"}};
  expect_error([&] { c.validate(); }, Status::Format, {"what_token"});
  c.tokenizer.special_tokens.clear();
  c.tokenizer.chat_template = std::string(kMaxChatTemplateBytes + 1, 'x');
  expect_error([&] { c.validate(); }, Status::Format, {"1 MiB"});
}

#undef EXPECT_CT_RENDER

}  // namespace
}  // namespace colibri
