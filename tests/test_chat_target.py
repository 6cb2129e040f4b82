"""A base model given the plain chat template (train/chat_target.py): it renders the very tokens our benches prompt base
targets with, trains each answer and nothing of the turns around it, and the written directory loads back with it."""

import pytest
from tokenizers import processors

from drafters.decode.benches import BenchItem, render_prompt
from drafters.errors import UserError
from drafters.targets import load_target, plain_chat_template
from drafters.tiny import build_tiny_tokenizer
from drafters.training.data import tokenize_conversation
from conftest import load_script  # tests/ is on sys.path under pytest

chat_target = load_script("train/chat_target.py")

ITEM = BenchItem("1", "writing", ("first question", "second question"))
HISTORY = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": " my answer.\n"}]


def base_tokenizer(adds_bos: bool):
    tokenizer = build_tiny_tokenizer(chat_template=False)
    if adds_bos:  # as Gemma's and Llama's tokenizers do: bos in front of every encoded text
        bos = tokenizer.bos_token
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tokenizer.bos_token_id)])
    return tokenizer


@pytest.mark.parametrize("adds_bos", [False, True])
def test_plain_template_renders_the_bench_prompt(adds_bos):
    tokenizer = base_tokenizer(adds_bos)
    template = plain_chat_template(tokenizer)
    for history in ([], HISTORY):
        messages = [*history, {"role": "user", "content": ITEM.turns[len(history) // 2]}]
        rendered = tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"]
        assert list(rendered) == render_prompt(tokenizer, ITEM, history)
    bench = tokenizer.decode(render_prompt(tokenizer, ITEM, HISTORY))
    assert bench.endswith("User: first question\n\nAssistant: my answer.\n\n\nUser: second question\n\nAssistant:")
    assert bench.startswith(tokenizer.bos_token) == adds_bos


def test_plain_template_trains_each_answer_and_its_turn_break():
    tokenizer = base_tokenizer(adds_bos=True)
    tokenizer.chat_template = plain_chat_template(tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, *HISTORY,
                {"role": "user", "content": "second question"}, {"role": "assistant", "content": " two"}]
    tokens = tokenize_conversation(tokenizer, messages)
    trained = [t for t, keep in zip(tokens.input_ids, tokens.loss_mask) if keep]
    assert tokenizer.decode(trained) == " my answer.\n\n\n two\n\n"
    assert tokenizer.decode(tokens.input_ids).startswith(f"{tokenizer.bos_token}System: Be brief.\n\nUser: ")


def test_cli_writes_a_target_that_loads_with_the_template(tmp_path, capsys):
    out = tmp_path / "plain"
    chat_target.main(["tiny-random-llama", str(out)])
    loaded = load_target(str(out))
    assert loaded.tokenizer.chat_template == plain_chat_template(loaded.tokenizer)
    assert "target: " + str(out) in capsys.readouterr().out
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(UserError, match="already exists"):
        chat_target.main(["tiny-random-llama", str(out)])
    assert sorted(p.name for p in out.iterdir()) == before


def test_cli_refuses_an_unreadable_template_before_loading(tmp_path):
    with pytest.raises(UserError, match=r"--template .*missing\.jinja: cannot be read"):
        chat_target.main(["no-such-target", str(tmp_path / "out"), "--template", str(tmp_path / "missing.jinja")])
    assert not (tmp_path / "out").exists()


def test_check_refuses_a_template_that_is_not_the_bench_prompt():
    # a template that differs from the bench's text is caught before anything is written
    tokenizer = base_tokenizer(adds_bos=True)
    wrong = plain_chat_template(tokenizer).replace("{{ bos_token }}", "")
    with pytest.raises(UserError, match="the plain template renders"):
        chat_target.check_plain(tokenizer, wrong)


@pytest.mark.parametrize("text, refusal", [
    ("   \n", "is empty"),
    ("{% for m in messages %}{{ m['content'] }", "training cannot use it"),  # not Jinja
    ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}",
     "no answer token is trained"),
])
def test_cli_refuses_a_template_training_cannot_use(tmp_path, text, refusal):
    template = tmp_path / "t.jinja"
    template.write_text(text)
    with pytest.raises(UserError, match=refusal):
        chat_target.main(["tiny-random-llama", str(tmp_path / "out"), "--template", str(template)])
    assert not (tmp_path / "out").exists()


def test_a_template_file_that_training_can_use_is_written(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(build_tiny_tokenizer().chat_template)  # ChatML
    chat_target.main(["tiny-random-llama", str(tmp_path / "out"), "--template", str(template)])
    assert load_target(str(tmp_path / "out")).tokenizer.chat_template == template.read_text()


def test_llama_cpp_refuses_a_drafter_on_gemma3_before_converting_the_target(tmp_path, monkeypatch, capsys):
    llama_cpp = load_script("eval/llama_cpp.py")
    monkeypatch.setattr(llama_cpp, "target_gguf", lambda *a, **k: pytest.fail("the target was converted"))
    assert llama_cpp.main(["--target", "tiny-random-gemma3", "--drafter", str(tmp_path / "drafter")]) == 1
    assert "Gemma-3" in capsys.readouterr().err
