// Jinja chat templates (jinja.h): a few lines of Python build the environment once and keep each
// compiled template; the C++ side passes the variables as one JSON text.
#if TILLER_HAVE_PYTHON
#include "python/py_ref.h"
#endif

#include "python/jinja.h"

#include <fmt/format.h>

#include "python/interpreter.h"
#include "tiller/core/error.h"

namespace tiller::python {

#if TILLER_HAVE_PYTHON
namespace {

// render(source, context_json) -> str. The environment follows transformers' chat templates
// (utils/chat_template_utils.py), so a template renders here as it does there and in vLLM.
constexpr const char* kJinjaSource = R"PY(
import json
from datetime import datetime

try:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError as e:
    raise ImportError('jinja2 is not installed in the embedded Python (pip install jinja2)') from e


class _Generation(jinja2.ext.Extension):
    # {% generation %}...{% endgeneration %} marks the assistant's tokens for a training mask;
    # rendering keeps the body as it is.
    tags = {'generation'}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(['name:endgeneration'], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method('_body'), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


_env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                     extensions=[_Generation, jinja2.ext.loopcontrols])
_env.filters['tojson'] = _tojson
_env.globals['raise_exception'] = _raise_exception
_env.globals['strftime_now'] = _strftime_now
_compiled = {}


def render(source, context_json):
    t = _compiled.get(source)
    if t is None:
        t = _compiled[source] = _env.from_string(source)
    return t.render(**json.loads(context_json))
)PY";

Ref g_module;  // under the GIL
std::string g_module_error;

}  // namespace

std::string render_jinja(const std::string& source, const std::string& context_json) {
  start();
  Gil gil;
  if (!g_module && g_module_error.empty()) {
    g_module = module_from_source("tiller_jinja", kJinjaSource, g_module_error);
    if (!g_module && g_module_error.empty()) g_module_error = "the module did not load";
  }
  if (!g_module) throw ConfigError(fmt::format("cannot render chat templates: {}", g_module_error));
  Ref render(PyObject_GetAttrString(g_module.get(), "render"));
  Ref src(PyUnicode_FromStringAndSize(source.data(), static_cast<Py_ssize_t>(source.size())));
  Ref ctx(PyUnicode_FromStringAndSize(context_json.data(), static_cast<Py_ssize_t>(context_json.size())));
  if (!render || !src || !ctx) throw ConfigError(fmt::format("cannot render the chat template: {}", take_error()));
  Ref out(PyObject_CallFunctionObjArgs(render.get(), src.get(), ctx.get(), nullptr));
  if (!out) throw ConfigError(fmt::format("the chat template failed: {}", take_error()));
  if (!PyUnicode_Check(out.get())) throw ConfigError("the chat template rendered something that is not text");
  return utf8(out.get());
}

#else  // built without Python's development files

std::string render_jinja(const std::string&, const std::string&) {
  start();  // throws: this build has no embedded Python
  return "";
}

#endif

}  // namespace tiller::python
