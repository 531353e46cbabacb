// agent.harness = FILE.py:FUNCTION (tiller/controller/agent.h): the user's agent as a Python function,
// run by the embedded interpreter (interpreter.h) on the openai_agent loop's threads.
//
// The file is loaded once as a module of its own (its folder first on sys.path). The function is
// called once per sample with the keywords it names, out of: base_url, api_key, model (for
// openai.OpenAI(base_url=..., api_key=...) and its requests), prompt (the dataset's text), label
// (str, or the JSON value when the dataset's label is not a string), data_source, extra_info (the
// JSON value, None when absent), sample, step, prompt_line, and timeout_s (seconds left of
// agent.timeout_s); a function taking **kwargs gets them all. It returns the sample's reward (a
// number, or a dict with "score"), or None to leave the sample to the job's reward.
//
// Errors are one line: loading names the file and line (a syntax error, an exception while the
// module runs, a missing function, a parameter tiller cannot pass: ConfigError); a call that raises
// names the exception and the file and line in the harness where it passed (Error).
//
// Threading: run() from any thread; each call holds the GIL while Python runs (an agent waiting on
// its HTTP requests releases it, so calls overlap).
#pragma once

#include <memory>
#include <string>

#include "tiller/controller/agent.h"

namespace tiller::python {

// Loads FILE.py:FUNCTION (ConfigError as above; also when this build has no Python).
std::shared_ptr<controller::AgentHarness> python_agent_harness(const std::string& spec);

}  // namespace tiller::python
