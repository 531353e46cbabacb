#!/usr/bin/env python3
"""Makes the Hugging Face fixtures tiller's model tests compare against, with the real libraries
(transformers, tokenizers, safetensors, sentencepiece; CPU, fp32).

  make_hf_fixtures.py OUT_DIR

OUT_DIR/models/<name>/       random tiny Llama, Qwen2, Qwen3, Mistral checkpoints (sharded
                             safetensors + index) and a Qwen2 value model (score head)
OUT_DIR/models/reference.json  per model: input ids, greedy continuations, value-head scores
OUT_DIR/models/<name>/reference_logits.safetensors  fp32 logits of each input
OUT_DIR/models/<name>-lora/  PEFT LoRA adapters of llama and qwen2, their logits and gradients;
                             <name>-lora-merged/ their merge_and_unload
OUT_DIR/tokenizers/<name>/   byte-level BPE tokenizer.json files trained on local text, and a
                             SentencePiece model
OUT_DIR/tokenizers/reference.json  per tokenizer: the corpus, its ids and decodings

Skips the work when OUT_DIR/stamp holds this script's hash.
"""
import hashlib
import json
import os
import sys
from pathlib import Path

OUT = Path(sys.argv[1])
HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
STAMP = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
if (OUT / "stamp").exists() and (OUT / "stamp").read_text() == STAMP:
    print(f"fixtures in {OUT} are current")
    sys.exit(0)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

torch.manual_seed(0)

# --- tokenizers ---------------------------------------------------------------------------------
CORPUS = [
    "Hello, world! This is a test.",
    "naïve café résumé — Ærøskøbing, Straße, façade",
    "cafe\u0301 vs café (decomposed vs composed)",
    "今天天气很好，我们去公园散步吧。日本語のテキストも。한국어 문장.",
    "👩‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 thumbs, 🤖 robot",
    "a  b   c    d\t\te\n\n\nf  \n  g   ",
    "line1\r\nline2\r\n\tindented\r\n",
    "1234567890 3.14159 2024-11-21 +1 (555) 010-9999 1,000,000",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>",
    "text<|endoftext|>more text<|endoftext|>",
    "I'm sure they'll say it's fine, we've done what you'd DON'T",
    "def f(x):\n    return x**2  # square\n",
    "before  <sep>  after<sep>end",
    "qzx qzxs aqzx qzx. éqzx qzxé 1qzx —qzx— _qzx (qzx)",
    "x\u3000<sep>\u00a0y <sep>\u2003",
    "",
    " ",
    "\n",
    "Ünïcödé ∑∫√ ∞ ≠ ≈ ← → ⊂ ⊃",
    "مرحبا بالعالم שלום עולם नमस्ते दुनिया",
    "Pneumonoultramicroscopicsilicovolcanoconiosis",
    "\u00a0non-breaking\u00a0space and\u2003em space",
    "   leading and trailing   ",
    "a\u0085b c x\u200bz  \u180e y \u2028line\u2029para\u000bvt\u000cff",
]

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def training_text():
    lines = []
    for p in sorted(REPO.glob("docs/*.md")) + [REPO / "README.md"]:
        lines += p.read_text(encoding="utf-8").splitlines()
    # The single_word added token stays out of training, so that it gets an id of its own.
    return lines + [t for t in CORPUS if "qzx" not in t] * 20


def make_bpe(kind):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    if kind == "llama3":
        tok = Tokenizer(models.BPE(ignore_merges=True))
    else:
        tok = Tokenizer(models.BPE())
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        specials = ["<|endoftext|>"]
    elif kind == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text(), trainer=trainer)
    if kind == "llama3":
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                          special_tokens=[("<|begin_of_text|>", bos)])])
        tok.add_tokens([AddedToken("<sep>", lstrip=True, rstrip=True, special=False)])
        config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    elif kind == "qwen2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    else:
        tok.add_tokens([AddedToken("qzx", single_word=True, normalized=False)])
        config = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    return tok, config


def write_tokenizers(root):
    ref = {}
    for kind in ["gpt2", "qwen2", "llama3"]:
        tok, config = make_bpe(kind)
        d = root / kind
        d.mkdir(parents=True, exist_ok=True)
        tok.save(str(d / "tokenizer.json"))
        if kind == "gpt2":
            # The older serialisation of merges ("a b" strings) that most published files use.
            doc = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
            doc["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in doc["model"]["merges"]]
            (d / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
            from tokenizers import Tokenizer
            tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps(config))
        cases = []
        for text in CORPUS:
            ids = tok.encode(text, add_special_tokens=False).ids
            cases.append({"text": text, "ids": ids,
                          "ids_with_special": tok.encode(text, add_special_tokens=True).ids,
                          "decoded": tok.decode(ids, skip_special_tokens=False),
                          "decoded_skip_special": tok.decode(ids, skip_special_tokens=True)})
        ref[kind] = {"vocab_size": tok.get_vocab_size(with_added_tokens=True), "cases": cases}

    import sentencepiece as spm
    d = root / "sentencepiece"
    d.mkdir(parents=True, exist_ok=True)
    text_file = d / "train.txt"
    text_file.write_text("\n".join(l for l in training_text() if l.strip()), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(text_file), model_prefix=str(d / "tokenizer"), vocab_size=600,
                                   model_type="bpe", character_coverage=1.0, byte_fallback=True,
                                   bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    text_file.unlink()
    (d / "tokenizer.vocab").unlink()
    sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
    plain = [t for t in CORPUS if "<" not in t]
    ref["sentencepiece"] = {"vocab_size": sp.get_piece_size(),
                            "cases": [{"text": t, "ids": sp.encode(t), "decoded": sp.decode(sp.encode(t))} for t in plain]}
    (root / "reference.json").write_text(json.dumps(ref, ensure_ascii=False, indent=1), encoding="utf-8")


# --- models -------------------------------------------------------------------------------------
def common_config():
    return dict(vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, initializer_range=0.1,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)


def model_configs():
    from transformers import (LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config,
                              Qwen3MoeConfig)
    common = common_config()
    return {
        # Llama 3.1 style: llama3 RoPE scaling, untied embeddings.
        "llama": LlamaConfig(**common, max_position_embeddings=64, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 16}),
        # Qwen2: qkv bias, tied embeddings, linear RoPE scaling.
        "qwen2": Qwen2Config(**common, max_position_embeddings=64, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0}),
        # Qwen3: q/k norm, head_dim decoupled from hidden/heads, yarn.
        "qwen3": Qwen3Config(**{**common, "num_key_value_heads": 1}, head_dim=32, max_position_embeddings=64,
                             tie_word_embeddings=False,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                              "original_max_position_embeddings": 16}),
        # Mistral: sliding window shorter than the inputs, dynamic NTK past max_position_embeddings.
        "mistral": MistralConfig(**common, max_position_embeddings=16, sliding_window=8, tie_word_embeddings=False,
                                 rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
        # Mixtures of experts. Qwen3-MoE: 8 experts, top 2 renormalised, layer 1 dense.
        "qwen3_moe": Qwen3MoeConfig(**common, head_dim=32, max_position_embeddings=64, tie_word_embeddings=False,
                                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                    norm_topk_prob=True, mlp_only_layers=[1]),
        # Qwen2-MoE: a shared expert behind its sigmoid gate, top 2 not renormalised, qkv bias, tied.
        "qwen2_moe": Qwen2MoeConfig(**common, max_position_embeddings=64, tie_word_embeddings=True, num_experts=6,
                                    num_experts_per_tok=2, moe_intermediate_size=48,
                                    shared_expert_intermediate_size=96, norm_topk_prob=False),
        # Mixtral: 4 experts of intermediate_size, top 2, a sliding window shorter than the inputs.
        "mixtral": MixtralConfig(**common, max_position_embeddings=64, sliding_window=8, tie_word_embeddings=False,
                                 num_local_experts=4, num_experts_per_tok=2),
    }


def randomize(model):
    # Non-trivial values everywhere (norm weights and biases too), so every parameter matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)


def write_models(root):
    from transformers import AutoModelForCausalLM, Qwen2ForSequenceClassification
    inputs = [[5, 17, 42, 99, 7], list(range(10, 27)), [int(x) for x in torch.randint(3, 300, (24,))]]
    ref = {}
    for name, cfg in model_configs().items():
        cfg._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        randomize(model)
        d = root / name
        model.save_pretrained(str(d), max_shard_size="60KB")
        logits = {}
        with torch.no_grad():
            for i, ids in enumerate(inputs):
                logits[f"logits_{i}"] = model(torch.tensor([ids])).logits[0].contiguous()
            greedy = []
            for ids in inputs[:2]:
                out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                     pad_token_id=0, min_new_tokens=12)
                greedy.append(out[0, len(ids):].tolist())
        save_file(logits, str(d / "reference_logits.safetensors"))
        ref[name] = {"inputs": inputs, "greedy": greedy}

    # A chat model with the qwen2 tokenizer, for `tiller generate` end to end (check_cli.py).
    from tokenizers import Tokenizer
    from transformers import Qwen2Config
    tok = Tokenizer.from_file(str(OUT / "tokenizers" / "qwen2" / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    cfg = Qwen2Config(**{**common_config(), "vocab_size": tok.get_vocab_size(), "eos_token_id": eos},
                      max_position_embeddings=256, tie_word_embeddings=True)
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    randomize(model)
    d = root / "qwen2-chat"
    model.save_pretrained(str(d))
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        (d / f).write_bytes((OUT / "tokenizers" / "qwen2" / f).read_bytes())
    prompts = ["What is 2+2?", "Write a haiku about autumn leaves.", "naïve café 你好 👍🏽"]
    prompt_ids, greedy = [], []
    with torch.no_grad():
        for p in prompts:
            ids = tok.encode(f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n").ids
            out = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=0)
            prompt_ids.append(ids)
            greedy.append(out[0, len(ids):].tolist())
    ref["qwen2-chat"] = {"prompts": prompts, "prompt_ids": prompt_ids, "greedy": greedy,
                         "responses": [tok.decode(g, skip_special_tokens=True) for g in greedy]}

    # Supervised fine-tuning's loss (tiller's sft_loss over packed log-probs): transformers' causal-LM
    # loss on a right-padded batch whose prompt tokens and padding are labelled -100, its gradient in
    # the final norm's weight, and each sequence's own loss (the sequence mean's terms); for Qwen2
    # (ref["sft"]) and Llama (ref["sft_llama"]).
    for name, key in [("qwen2", "sft"), ("llama", "sft_llama")]:
        model = AutoModelForCausalLM.from_pretrained(str(root / name), dtype=torch.float32).eval()
        seqs = [[5, 17, 42, 99, 7, 8, 9], list(range(10, 21)), [3, 4, 250, 251, 252]]
        prompt_lens = [3, 5, 2]
        width = max(len(x) for x in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        labels = torch.full((len(seqs), width), -100, dtype=torch.long)
        for i, (x, p) in enumerate(zip(seqs, prompt_lens)):
            ids[i, :len(x)] = torch.tensor(x)
            mask[i, :len(x)] = 1
            labels[i, p:len(x)] = torch.tensor(x[p:])
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        with torch.no_grad():
            per_seq = [float(model(input_ids=torch.tensor([x]), labels=torch.tensor([[-100] * p + x[p:]])).loss)
                       for x, p in zip(seqs, prompt_lens)]
        save_file({"norm_grad": model.model.norm.weight.grad.contiguous()}, str(root / name / "sft_reference.safetensors"))
        ref[key] = {"model": name, "seqs": seqs, "prompt_lens": prompt_lens, "loss": float(out.loss),
                    "per_sequence": per_seq}

    cfg = model_configs()["qwen2"]
    cfg.num_labels = 1
    cfg._attn_implementation = "eager"
    vm = Qwen2ForSequenceClassification(cfg).eval()
    randomize(vm)
    d = root / "qwen2-value"
    vm.save_pretrained(str(d), max_shard_size="60KB")
    with torch.no_grad():
        scores = [float(vm(torch.tensor([ids])).logits[0, 0]) for ids in inputs]
    ref["qwen2-value"] = {"inputs": inputs, "scores": scores}

    # LoRA with PEFT: random A and B (PEFT starts B at zero, which would hide the adapters) on
    # llama (all-linear) and qwen2 (three projections, rsLoRA); the logits of each input, the
    # adapters' gradients of input 2's next-token log-prob sum, and merge_and_unload's model.
    from peft import LoraConfig, get_peft_model
    for name, kw in [("llama", dict(r=4, lora_alpha=8, target_modules="all-linear")),
                     ("qwen2", dict(r=3, lora_alpha=5, target_modules=["q_proj", "v_proj", "down_proj"],
                                    use_rslora=True))]:
        base = AutoModelForCausalLM.from_pretrained(str(root / name), dtype=torch.float32).eval()
        model = get_peft_model(base, LoraConfig(lora_dropout=0.0, **kw)).eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.normal_(0.0, 0.1)
        d = root / f"{name}-lora"
        model.save_pretrained(str(d))
        with torch.no_grad():
            logits = {f"logits_{i}": model(torch.tensor([ids])).logits[0].contiguous() for i, ids in enumerate(inputs)}
        ids = torch.tensor([inputs[2]])
        lp = model(ids).logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:].unsqueeze(1)).sum()
        lp.backward()
        grads = {n.replace("base_model.model.", "").replace(".default", ""): p.grad.contiguous()
                 for n, p in model.named_parameters() if p.grad is not None}
        save_file(logits, str(d / "reference_logits.safetensors"))
        save_file(grads, str(d / "reference_grads.safetensors"))
        layer = model.base_model.model.model.layers[0]
        targets = sum(1 for m in [*layer.self_attn.children(), *layer.mlp.children()] if hasattr(m, "lora_A"))
        ref[f"{name}-lora"] = {"r": kw["r"], "use_rslora": kw.get("use_rslora", False),
                               "scaling": layer.self_attn.q_proj.scaling["default"], "targets": targets}
        model.merge_and_unload().save_pretrained(str(root / f"{name}-lora-merged"))
    # An adapter of the chat model for `tiller generate --lora` and `tiller merge-lora`: PEFT's
    # greedy continuations of the chat prompts.
    base = AutoModelForCausalLM.from_pretrained(str(root / "qwen2-chat"), dtype=torch.float32).eval()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                            target_modules=["q_proj", "v_proj", "up_proj"])).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0.0, 0.1)
        greedy = []
        for ids in ref["qwen2-chat"]["prompt_ids"]:
            out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=eos,
                                 pad_token_id=0)
            greedy.append(out[0, len(ids):].tolist())
    model.save_pretrained(str(root / "qwen2-chat-lora"))
    ref["qwen2-chat-lora"] = {"greedy": greedy}
    (root / "reference.json").write_text(json.dumps(ref, indent=1))


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    write_tokenizers(OUT / "tokenizers")
    write_models(OUT / "models")
    (OUT / "stamp").write_text(STAMP)
    print(f"fixtures written to {OUT}")
