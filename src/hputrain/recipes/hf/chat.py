"""`hputrain generate --model DIR --chat QUESTION`: one answer from a local Hugging Face model
folder (a download, or a run's output_dir/final, a LoRA run's adapter folder included), through
its tokenizer's chat template and the static-shape generator that GRPO's rollouts run on
(execution/generation.py: a static key/value cache, sampling on the device), eagerly: for one
answer a graph capture costs more than it saves.

The question is rendered as a one-message conversation with the generation prompt (the header
the template writes before an assistant's turn), so the model continues as the assistant it was
trained to be. Generation stops at the end of the turn: the eos token, and the template's own
end-of-turn marker (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, ...; found by rendering, as
data/chat.py finds what SFT trains on), which many models emit instead of eos; a model that is
not stopped there keeps writing the next turn. Only the answer's text is returned.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...data.chat import ChatTemplate
from ...errors import InputError
from ...execution.generation import Sampling, StaticGenerator, end_token_ids


@dataclass
class ChatAnswer:
    text: str
    """The answer, special tokens (the end-of-turn marker) left out."""
    tokens: int
    """Tokens generated, the end-of-turn token included."""
    prompt_tokens: int
    """Tokens of the rendered question."""
    stop_token_ids: list[int]
    """What generation stopped at: eos, then the template's end-of-turn token."""


def stop_token_ids(tokenizer, model_eos) -> list[int]:
    """eos (the tokenizer's and the model's generation config's: end_token_ids, GRPO's) and the
    chat template's end-of-turn marker, when it is a single token; in that order, each once."""
    ids = end_token_ids(tokenizer.eos_token_id, model_eos)
    marker = ChatTemplate(tokenizer).end_of_turn()
    if marker is not None:
        encoded = tokenizer.encode(marker, add_special_tokens=False)
        if len(encoded) == 1:  # a marker spelled in several tokens cannot be an eos id
            ids.append(encoded[0])
    return list(dict.fromkeys(i for i in ids if isinstance(i, int)))


def chat_answer(folder: Path, question: str, accelerator, *, max_new_tokens: int,
                temperature: float = 0.0, top_k: int | None = None,
                base_model: str | None = None) -> ChatAnswer:
    """The model's answer to `question` (see the module docstring): greedy with temperature 0,
    else sampled (seed the generator first). `folder` may be an adapter folder (on its base
    model, or `base_model`): PEFT's model generates with the adapters."""
    from .folders import load_model

    model, tokenizer = load_model(folder, base_model=base_model)
    if not isinstance(getattr(tokenizer, "chat_template", None), str):
        raise InputError(f"--model {folder}: its tokenizer has no chat template, so --chat cannot "
                         "render the question: give a model folder whose tokenizer has one "
                         "(tokenizer.chat_template)")
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                            add_generation_prompt=True, return_dict=True)
    return answer(model, tokenizer, folder, accelerator, list(encoded["input_ids"]),
                  max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k)


def answer(model, tokenizer, folder, accelerator, prompt: list[int], *, max_new_tokens: int,
           temperature: float, top_k: int | None, prefill=None) -> ChatAnswer:
    """The model's answer to the prompt's token ids (an image model's `prefill` beside them:
    kinds/vlm/chat.py), through the static-shape generator on the accelerator's first
    device, up to the first of its stop tokens."""
    device = accelerator.setup(0)
    model = model.to(device).eval()
    stops = stop_token_ids(tokenizer, model.generation_config.eos_token_id)
    pad = next((t for t in (tokenizer.pad_token_id, *stops) if t is not None), None)
    if not stops or pad is None:
        raise InputError(f"--model {folder}: neither its tokenizer nor its generation config "
                         "names an eos token, so the answer has no end")
    engine = StaticGenerator(model, accelerator, max_completion_length=max_new_tokens,
                             eos_token_ids=stops, pad_token_id=pad, graphs=False)
    rollout = engine.generate([prompt], Sampling(temperature=temperature, top_k=top_k or 0),
                              prefill=prefill)
    length = int(rollout.completion_mask[0].sum())  # the one read back: up to the first stop
    new = rollout.completion_ids[0, :length].tolist()
    return ChatAnswer(tokenizer.decode(new, skip_special_tokens=True).strip(), len(new),
                      len(prompt), stops)
