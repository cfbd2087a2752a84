"""The tiny components every tiny model folder is built from (random weights, from configs):
a byte-level CLIP tokenizer, small CLIP text encoders, an AutoencoderKL and a UNet. The
family modules (``integrations/families/``) assemble them into folders laid out like their
real models (``Family.tiny``); tiny.py is the command that writes one.

The CLIP tokenizer is a BPE tokenizer without merges over a byte-level vocabulary (every
byte, and every byte ending a word): any text tokenizes, one token per character. The T5
tokenizer is a Unigram model over single characters written as a ``tokenizer.json`` with the
``tokenizers`` library (what transformers loads offline without sentencepiece: a folder
holding only ``spiece.model`` would need it).
"""

from __future__ import annotations

import torch

__all__ = ["tiny_tokenizer", "tiny_text_encoder", "tiny_vae", "tiny_unet", "tiny_t5",
           "tiny_t5_tokenizer", "tiny_qwen2_tokenizer", "tiny_qwen3"]


def _byte_chars() -> list[str]:
    """GPT-2/CLIP's reversible byte -> unicode table (printable bytes map to themselves)."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]


def tiny_tokenizer(max_length: int = 77, pad_token: str = "<|endoftext|>"):
    """A CLIPTokenizer with a byte-level vocabulary (515 ids) and no merges; SDXL's second
    tokenizer pads with ``pad_token="!"``."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in _byte_chars():
        vocab.setdefault(c, len(vocab))
    for c in _byte_chars():
        vocab.setdefault(c + "</w>", len(vocab))
    tok = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length,
                        pad_token=pad_token)
    return tok


def tiny_text_encoder(hidden: int = 32, layers: int = 2, vocab_size: int = 514,
                      max_length: int = 77, seed: int = 0, projection: int | None = None):
    """A 2-layer CLIPTextModel of width ``hidden`` (random weights from ``seed``); with
    ``projection``, a CLIPTextModelWithProjection whose pooled output is that wide (SDXL's
    second text encoder)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 16),
                         max_position_embeddings=max_length, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1, projection_dim=projection or hidden)
    torch.manual_seed(seed)
    return (CLIPTextModelWithProjection(cfg) if projection else CLIPTextModel(cfg)).eval()


def tiny_vae(channels: int = 3, latent_channels: int = 4, widths: tuple[int, ...] = (16, 32),
             sample_size: int = 32, seed: int = 0, **config):
    """An AutoencoderKL with ``len(widths)`` levels (downsampling 2**(len-1)); ``config``:
    more of its config (SDXL's ``scaling_factor``, ``force_upcast``)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    n = len(widths)
    return AutoencoderKL(in_channels=channels, out_channels=channels,
                         down_block_types=("DownEncoderBlock2D",) * n,
                         up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=widths,
                         latent_channels=latent_channels, norm_num_groups=8, layers_per_block=1,
                         sample_size=sample_size, **config).eval()


def tiny_unet(cross_attention_dim: int = 32, sample_size: int = 16, in_channels: int = 4,
              widths: tuple[int, int] = (32, 64), seed: int = 0):
    """A 2-level UNet2DConditionModel with cross-attention at the first level."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=sample_size, in_channels=in_channels, out_channels=in_channels,
        layers_per_block=1, block_out_channels=widths,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=cross_attention_dim, attention_head_dim=8, norm_num_groups=8)


def tiny_t5_tokenizer(max_length: int = 512):
    """A T5 tokenizer (transformers' tokenizers-backed ``T5Tokenizer``) over a Unigram
    vocabulary of T5's special tokens (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2) and each
    printable ASCII character, with and without the word-start mark "▁"; SentencePiece's
    Metaspace pre-tokenizer and T5's ``</s>`` appended, as the real one. Saved, it is a
    ``tokenizer.json``: it loads offline with no sentencepiece model."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    chars = [chr(c) for c in range(33, 127)]
    pieces = ([("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
              + [("\u2581" + c, -2.0) for c in chars] + [(c, -3.0) for c in chars])
    tk = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tk.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tk.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
    cls = getattr(transformers, "T5TokenizerFast", None) or transformers.T5Tokenizer
    return cls(tokenizer_object=tk, eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
               model_max_length=max_length, extra_ids=0)


def tiny_t5(d_model: int = 48, layers: int = 2, vocab_size: int = 192, seed: int = 0):
    """A ``layers``-layer T5EncoderModel of width ``d_model`` (random weights from
    ``seed``; gated-GELU feed-forward as T5 v1.1, the encoder SD3 and FLUX.1 use)."""
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=d_model // 4,
                   d_ff=2 * d_model, num_layers=layers, num_heads=4,
                   feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
                   relative_attention_max_distance=16, pad_token_id=0, eos_token_id=1,
                   decoder_start_token_id=0)
    torch.manual_seed(seed)
    return T5EncoderModel(cfg).eval()


#: a Qwen-style chat template (the user's turn, then the assistant's opened; thinking off
#: adds the empty think block, as Qwen3's own template)
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking "
    "is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def tiny_qwen2_tokenizer(max_length: int = 512):
    """A Qwen2 tokenizer (transformers' tokenizers-backed ``Qwen2Tokenizer``): byte-level
    BPE over the 256 byte symbols without merges, Qwen's special tokens (``<|endoftext|>``
    the pad, ``<|im_start|>``, ``<|im_end|>``, ``<think>``, ``</think>``) and a Qwen-style
    chat template. Saved, it is a ``tokenizer.json`` and the template: it loads offline."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab: dict[str, int] = {}
    for c in _byte_chars():
        vocab.setdefault(c, len(vocab))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    cls = getattr(transformers, "Qwen2TokenizerFast", None) or transformers.Qwen2Tokenizer
    return cls(tokenizer_object=tk, pad_token="<|endoftext|>", eos_token="<|im_end|>",
               unk_token=None, bos_token=None,
               additional_special_tokens=["<|im_start|>", "<|im_end|>", "<think>",
                                          "</think>"],
               model_max_length=max_length, chat_template=QWEN_CHAT_TEMPLATE)


def tiny_qwen3(hidden: int = 32, layers: int = 2, vocab_size: int = 261,
               pad_token_id: int | None = None, seed: int = 0):
    """A ``layers``-layer Qwen3Model of width ``hidden`` (grouped-query attention, two
    heads over one key/value head, QK-norm; random weights from ``seed``)."""
    from transformers import Qwen3Config, Qwen3Model

    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=hidden // 2, max_position_embeddings=1024,
                      pad_token_id=pad_token_id)
    torch.manual_seed(seed)
    return Qwen3Model(cfg).eval()
