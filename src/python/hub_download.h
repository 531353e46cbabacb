// Downloads a model from the Hugging Face hub into the local cache through huggingface_hub's
// snapshot_download in the embedded interpreter (interpreter.h), as transformers and vLLM fetch
// models: the cache layout core/hub.h reads, HF_ENDPOINT, HF_TOKEN for gated models, its file
// locks (ranks of several nodes may fill one shared cache at once) and resumed partial files.
// Only the files tiller reads: *.json, *.safetensors, *.jinja, *.txt, *.model, *.tiktoken; no
// PyTorch .bin files and no original/ folder (Llama's consolidated weights).
//
// Threading: any thread; the call holds the GIL for the whole download.
#pragma once

#include <string>

namespace tiller::python {

// The snapshot folder of `repo` ("Qwen/Qwen2.5-7B-Instruct") at `revision` in `cache_dir`.
// ConfigError, one line naming `key` (the config key that named the model) and what failed (a
// missing package names the pip command; a failed download names the exception and the command
// that downloads by hand).
std::string download_hub_snapshot(const std::string& key, const std::string& repo, const std::string& revision,
                                  const std::string& cache_dir);

}  // namespace tiller::python
