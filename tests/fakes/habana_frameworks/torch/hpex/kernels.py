"""Fake hpex.kernels: FusedSDPA and the fused RoPE helpers, computed on the CPU from their
definitions (never through torch's scaled_dot_product_attention, so that tests can tell the two
apart). Every call is recorded with the options it got."""
import torch

from habana_frameworks import fake


class FusedSDPA:
    """Same positional contract as the real op: apply(q, k, v, attn_mask, dropout_p, is_causal,
    scale, softmax_mode, recompute_mode, valid_sequence_lengths, padding_side)."""

    @staticmethod
    def apply(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, softmax_mode="None",
              recompute_mode=None, valid_sequence_lengths=None, padding_side="left"):
        fake.record("FusedSDPA", {"is_causal": is_causal, "mask": attn_mask is not None, "dropout_p": dropout_p,
                                  "scale": scale, "softmax_mode": softmax_mode, "recompute": recompute_mode,
                                  "heads": (q.size(1), k.size(1))})
        if k.size(1) != q.size(1):
            raise RuntimeError("fake FusedSDPA: query and key/value head counts differ")
        scale = q.size(-1) ** -0.5 if scale is None else scale
        scores = (q @ k.transpose(-2, -1)).float() * scale
        if is_causal:
            future = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        if attn_mask is not None:
            scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                      else scores + attn_mask)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        if dropout_p > 0:
            probs = torch.nn.functional.dropout(probs, dropout_p)
        return probs @ v


def _rotate_half(x):
    half = x.size(-1) // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryPosEmbeddingHelperV1:
    """Fused RoPE (training form): apply(x, cos, sin, offset) = x·cos + rotate_half(x)·sin."""

    @staticmethod
    def apply(x, cos, sin, offset=0):
        fake.record("RotaryPosEmbeddingHelperV1", {"offset": offset})
        return x * cos + _rotate_half(x) * sin


class RotaryPosEmbeddingHelperV2:
    """Fused RoPE (inference form): apply(x, cos, sin, position_ids), cos and sin indexed by
    the positions."""

    @staticmethod
    def apply(x, cos, sin, position_ids):
        fake.record("RotaryPosEmbeddingHelperV2", None)
        cos, sin = cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)
        return x * cos + _rotate_half(x) * sin
