// Moved to tiller/text/chat_template.h (namespace tiller::text). This header forwards for one release.
#pragma once

#include "tiller/model/tokenizer.h"
#include "tiller/text/chat_template.h"

namespace tiller::model {
using text::apply_chat_template;
using text::apply_input_template;
using text::chat_format_name;
using text::ChatFormat;
using text::ChatMessage;
using text::ChatTemplate;
using text::job_chat_template;
using text::load_chat_template;
using text::observation_turn;
using text::parse_chat_format;
}  // namespace tiller::model
