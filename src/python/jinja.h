// Chat templates in Jinja, rendered as transformers' apply_chat_template renders them: jinja2's
// ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loopcontrols extension,
// a `{% generation %}` block that renders its body, and the globals and filters that templates on
// the Hub use (raise_exception, strftime_now, a tojson that keeps non-ASCII text and takes indent,
// separators and sort_keys). Runs in the embedded interpreter (interpreter.h) with its jinja2.
//
// Threading: any thread (each call takes the GIL). A compiled template is cached by its source.
#pragma once

#include <string>

namespace tiller::python {

// Renders `source` with the variables of `context_json` (a JSON object: messages, tools,
// add_generation_prompt, bos_token, ...). Throws ConfigError with the template's own message when
// it raises (raise_exception, an undefined variable it indexes) and when jinja2 is missing.
std::string render_jinja(const std::string& source, const std::string& context_json);

}  // namespace tiller::python
