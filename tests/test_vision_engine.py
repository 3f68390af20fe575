"""The vision-language engine path on its own: prompt preparation and ``VisionGenerator``.

On a tiny random Qwen2-VL built here: the server's prompt (its chat template
and mlx-vlm's processor, ``runtime.prompts.prepare_vision_chat``) is the
token sequence ``mlx_vlm.generate`` feeds for the same question and image;
``VisionGenerator`` yields, one token per ``next()``, the tokens
``mlx_vlm.generate`` gives, with and without an image; a sequence removed
mid-answer stops and the next one runs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("mlx_vlm")

import mlx.core as mx  # noqa: E402

from runtime.engine.vision_generator import VisionGenerator  # noqa: E402
from runtime.prompts import prepare_vision_chat  # noqa: E402
from runtime.tiny_vision_model import build_tiny_vision_model  # noqa: E402
from runtime.vision import ImageInput, vision_family  # noqa: E402

QUESTION = "What is this?"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm import load

    path = build_tiny_vision_model(tmp_path_factory.mktemp("tiny-vlm"), seed=2)
    model, processor = load(str(path))
    return path, model, processor, load_tokenizer(path)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    from PIL import Image

    picture = Image.new("RGB", (60, 40), (20, 90, 200))
    file = tmp_path_factory.mktemp("image") / "image.png"
    picture.save(file)
    return str(file), picture


def _argmax(logprobs):
    return mx.argmax(logprobs, axis=-1)


def _run(generator: VisionGenerator, uid: int) -> list[int]:
    tokens = []
    while True:
        _, generated = generator.next()
        assert [g.uid for g in generated] == [uid]
        tokens.append(generated[0].token)
        if generated[0].finish_reason is not None:
            assert generated[0].prompt_cache is None  # no prompt-cache entry for images
            return tokens


def _reference(model, processor, image_file: str | None) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) of mlx_vlm.generate, greedy, 8 tokens."""
    from mlx_vlm import generate
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs

    images = [image_file] if image_file else []
    prompt = apply_chat_template(processor, model.config, QUESTION, num_images=len(images))
    inputs = prepare_inputs(processor, images=images or None, prompts=prompt,
                            add_special_tokens=True)
    result = generate(model, processor, prompt, image=images or None, max_tokens=8,
                      temperature=0.0)
    assert result.token_ids, "the reference generated nothing"
    return inputs["input_ids"].reshape(-1).tolist(), list(result.token_ids)


def _ours(tokenizer, processor, picture) -> tuple[tuple[int, ...], object]:
    content = [{"type": "text", "text": QUESTION}, {"type": "image"}]
    prompt = prepare_vision_chat(
        tokenizer, processor, "qwen2_vl", [{"role": "user", "content": content}],
        [ImageInput("messages[0].content[1]", picture)], tools=None, template_args={},
    )
    return prompt.tokens, prompt.vision


def test_the_model_is_recognised_as_vision_language(loaded, tmp_path):
    path = loaded[0]
    assert vision_family(path) == "qwen2_vl"
    assert vision_family(tmp_path) is None  # no config.json: not one


def test_an_image_prompt_and_answer_equal_mlx_vlm_generate(loaded, image):
    path, model, processor, tokenizer = loaded
    ref_prompt, ref_answer = _reference(model, processor, image[0])
    tokens, vision = _ours(tokenizer, processor, image[1])
    assert list(tokens) == ref_prompt
    assert set(vision.arrays) >= {"pixel_values", "image_grid_thw"}
    generator = VisionGenerator(model, tokenizer)
    (uid,) = generator.insert_segments([[list(tokens)]], max_tokens=[8], samplers=[_argmax],
                                       vision_inputs=[vision])
    answer = _run(generator, uid)
    eos = set(tokenizer.eos_token_ids)
    assert [t for t in answer if t not in eos] == ref_answer


def test_a_text_prompt_equals_mlx_vlm_generate(loaded):
    path, model, processor, tokenizer = loaded
    ref_prompt, ref_answer = _reference(model, processor, None)
    generator = VisionGenerator(model, tokenizer)
    (uid,) = generator.insert_segments([[ref_prompt]], max_tokens=[8], samplers=[_argmax])
    eos = set(tokenizer.eos_token_ids)
    assert [t for t in _run(generator, uid) if t not in eos] == ref_answer


def test_a_removed_sequence_stops_and_the_next_runs(loaded, image):
    path, model, processor, tokenizer = loaded
    tokens, vision = _ours(tokenizer, processor, image[1])
    generator = VisionGenerator(model, tokenizer)
    first, second = generator.insert_segments(
        [[list(tokens)], [list(tokens)]], max_tokens=[8, 8], samplers=[_argmax, _argmax],
        vision_inputs=[vision, vision],
    )
    prompts, generated = generator.next()
    assert [p.uid for p in prompts] == [first] and prompts[0].progress == (len(tokens),) * 2
    assert [g.uid for g in generated] == [first] and generated[0].finish_reason is None
    generator.remove([first])
    answer = _run(generator, second)
    assert len(answer) == 8 or answer[-1] in tokenizer.eos_token_ids
    assert generator.next() == ([], [])
