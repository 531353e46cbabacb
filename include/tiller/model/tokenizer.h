// Moved to tiller/text/tokenizer.h (namespace tiller::text). This header forwards for one release.
#pragma once

#include "tiller/text/tokenizer.h"

namespace tiller::model {
using text::eos_token_ids;
using text::load_tokenizer;
using text::make_bpe_tokenizer;
using text::make_sentencepiece_tokenizer;
using text::Tokenizer;
}  // namespace tiller::model
