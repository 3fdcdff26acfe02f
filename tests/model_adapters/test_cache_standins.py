"""The cache contract on the trained stand-in models (real attention patterns, 12 layers):
chunk invariance, crop-then-continue, assisted decoding equal to greedy, left padding, for both
caches, with codebooks fitted on the model.

The stand-ins live outside the repository: set ``FKV_STANDINS`` to the folder holding
``standin-gpt2/`` and ``standin-qwen3/`` (each a ``from_pretrained`` checkpoint with its
tokenizer); without it these tests skip. Short sequences, float64 (the codes-only cache's decode
steps read the codes by float32 look-ups, hence its looser tolerance).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
from adapters_fixtures import torch, transformers

from model_adapters.caches.archiving import ArchivingCache
from model_adapters.caches.codes_attention import use_codes_attention
from model_adapters.caches.codes_only import CodesOnlyCache
from model_adapters.caches.window import archive_end
from model_adapters.models import cache_kwarg
from model_adapters.quant.quantizer import KVQuantizer

ROOT = os.environ.get("FKV_STANDINS")
pytestmark = pytest.mark.skipif(not ROOT, reason="FKV_STANDINS (the stand-in models' folder) "
                                                  "is not set")
NAMES = ["standin-gpt2", "standin-qwen3"]
KINDS = ["archiving", "codes_only"]
WINDOW = dict(sinks=4, recent=8, block=2)
CASES = pytest.mark.parametrize("name,kind", [(n, k) for n in NAMES for k in KINDS])


@functools.cache
def standin(name: str):
    """The stand-in in float64 on the codes attention, its text's token ids (the bundled book),
    and codebooks fitted on its K/V over 1,024 of them (two 16-centroid stages per side)."""
    folder = Path(ROOT or ".") / name
    if not (folder / "config.json").is_file():
        pytest.skip(f"{folder} holds no checkpoint")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    model = use_codes_attention(model.eval())
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    book = Path(__import__("fkvstore").__file__).parent / "data" / "the_time_machine.txt"
    text = book.read_text(encoding="utf-8")
    start = text.index("The Time Traveller (for so it will be convenient")
    ids = torch.tensor(tokenizer.encode(text[start : start + 12000]))
    q = KVQuantizer.fit(model, ids[200:1224], "perhead-k16-s2", iters=5, progress=False)
    return model, ids[:200], q


def new_cache(name, kind, **window):
    model, _, q = standin(name)
    cls = ArchivingCache if kind == "archiving" else CodesOnlyCache
    return cls(model, q, **(WINDOW | window))


def tolerance(kind):
    t = 1e-7 if kind == "archiving" else 2e-4
    return dict(rtol=t, atol=t)


def forward(model, cache, ids, **kw):
    with torch.no_grad():
        return model(ids, **{cache_kwarg(model): cache}, **kw).logits


@CASES
def test_chunks_and_cropped_drafts_compute_token_by_token(name, kind):
    model, tokens, _ = standin(name)
    ids, drafts = tokens[None, :40], tokens[None, 100:106]
    oracle = new_cache(name, kind)
    want = torch.cat([forward(model, oracle, ids[:, t : t + 1]) for t in range(40)], 1)
    cache, got, start = new_cache(name, kind), [], 0
    for size, rejected in [(13, 0), (1, 0), (7, 3), (4, 6), (1, 1), (14, 0)]:
        chunk = torch.cat([ids[:, start : start + size], drafts[:, :rejected]], 1)
        got.append(forward(model, cache, chunk)[:, :size])
        if rejected:
            cache.crop(-rejected)
        start += size
    assert start == 40 and cache.archived_tokens == archive_end(40, **WINDOW) - 4 == 28
    torch.testing.assert_close(torch.cat(got, 1), want, **tolerance(kind))


@CASES
def test_crop_then_continue_equals_a_fresh_run(name, kind):
    model, ids, _ = standin(name)
    cropped, fresh = new_cache(name, kind), new_cache(name, kind)
    forward(model, cropped, ids[None, :40])
    cropped.crop(-7)
    forward(model, fresh, ids[None, :33])
    more = ids[None, 60:68]
    torch.testing.assert_close(forward(model, cropped, more), forward(model, fresh, more),
                               **tolerance(kind))


def same_greedy_tokens(want, got) -> bool:
    """Equal tokens, or the first difference at a near tie of greedy's scores (< 1e-4)."""
    a, b = want.sequences[0], got.sequences[0]
    diff = (a != b).nonzero()
    if len(diff) == 0:
        return True
    top = want.scores[int(diff[0]) - (len(a) - len(want.scores))][0].topk(2).values
    return float(top[0] - top[1]) < 1e-4


@CASES
@pytest.mark.parametrize("drafter", ["self", "other"])
def test_assisted_decoding_returns_the_greedy_tokens(name, kind, drafter):
    model, ids, _ = standin(name)
    # the other stand-in shares the GPT-2 vocabulary: a real, often wrong, draft model
    assistant = model if drafter == "self" else standin(NAMES[1 - NAMES.index(name)])[0]
    settings = dict(max_new_tokens=32, do_sample=False, pad_token_id=0, output_scores=True,
                    return_dict_in_generate=True)
    prompt, kw = ids[None, :24], cache_kwarg(model)
    with torch.no_grad():
        want = model.generate(prompt, **settings, **{kw: new_cache(name, kind)})
        cache = new_cache(name, kind)
        got = model.generate(prompt, assistant_model=assistant, **settings, **{kw: cache})
    assert cache.archived_tokens > 0
    assert same_greedy_tokens(want, got)


@CASES
def test_a_padded_batch_scores_as_each_sequence_alone(name, kind):
    model, ids, _ = standin(name)
    short, long = ids[None, 50:66], ids[None, 100:124]
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, output_scores=True,
                    return_dict_in_generate=True)
    kw = cache_kwarg(model)
    with torch.no_grad():
        alone = [model.generate(s, **settings, **{kw: new_cache(name, kind)})
                 for s in (short, long)]
        batch = torch.cat([torch.cat([torch.zeros(1, 8, dtype=torch.long), short], 1), long])
        mask = (torch.arange(24)[None] >= torch.tensor([[8], [0]])).long()
        cache = new_cache(name, kind)
        both = model.generate(batch, attention_mask=mask, **settings, **{kw: cache})
    scores = torch.stack(both.scores, 1)
    for b, one in enumerate(alone):
        torch.testing.assert_close(scores[b : b + 1], torch.stack(one.scores, 1),
                                   **tolerance(kind))
    # each holds its prompt and 11 generated tokens, pads never archived
    assert cache.archived_per_sequence() == [archive_end(n, **WINDOW) - 4 for n in (27, 35)]
