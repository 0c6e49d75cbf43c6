"""The video LLM's data (issue 47): a Hugging Face chat template (Qwen's ChatML) puts the loss on the answer's tokens
alone, the byte template likewise, answers are parsed from generations, and accuracy is reported per category."""

from __future__ import annotations

import json

import pytest

from attnlab.data.video_qa import IGNORE, ByteChat, HFChat, QAItem
from attnlab.train.tasks.vlm import mcq_metrics, parse_choice

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # Qwen2's template, its system turn cut


def test_chatml_template_labels_the_answer_tokens_only(tmp_path):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    words = ["<|im_start|>", "<|im_end|>", "user", "assistant", "\n", "Which", "?", "A", ".", "B", "x", "y", "[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\|im_start\|>|<\|im_end\|>|\n|\?|\.| "), "isolated")
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    chat = HFChat(tmp_path)
    media = [chat.image_id, chat.image_id, chat.probe_id]
    ids, labels = chat.encode([("user", "<video>\nWhich?"), ("assistant", "B")], media)
    text = [chat.tok.convert_ids_to_tokens(i) for i in ids]
    assert text.count("<image>") == 2 and text.count("<probe>") == 1
    answer = [t for t, lab in zip(text, labels) if lab != IGNORE]
    assert answer[0] == "B" and answer[1] == "<|im_end|>"  # the answer and its end, nothing of the prompt
    prompt = chat.prompt([("user", "<video>\nWhich?")], media)
    assert ids[:len(prompt)] == prompt and labels[len(prompt)] == ids[len(prompt)] != IGNORE
    assert labels[len(prompt) - 1] == IGNORE


def test_byte_template_labels_the_answer_tokens_only():
    chat = ByteChat()
    ids, labels = chat.encode([("user", "<video>\nQ?"), ("assistant", "C")], [chat.IMAGE, chat.PROBE])
    assert [t for t in labels if t != IGNORE] == [ord("C"), chat.END]
    assert ids.count(chat.IMAGE) == 1 and ids.count(chat.PROBE) == 1


@pytest.mark.parametrize("text, want", [("B", 1), ("(C) because", 2), ("The answer is D.", 3), ("none", -1),
                                        ("Answer: a", -1)])
def test_answer_parsing(text, want):
    assert parse_choice(text, "ABCD") == want


def test_accuracy_overall_and_per_category():
    items = [QAItem(i, None, "video", [], cat, ans) for i, (cat, ans) in
             enumerate([("hand id", 0), ("hand id", 1), ("task regions", 2), ("task regions", 3), ("", -1)])]
    out = mcq_metrics(items, [0, 0, 2, 2, 1], [1.0, 2.0])
    assert out == {"accuracy": 50.0, "test_loss": 1.5, "acc_hand_id": 50.0, "acc_task_regions": 50.0}
