"""RunnerOptions names two user mistakes with their fix (fresh-user trial, 2026-12-02): a YAML
boolean where a word was meant (``-p engine_options '{pdl: on}'`` arrived as ``pdl=True``), and
an engine option inside a kernel-options dict (``--decode-kernel-options '{"pdl": "early"}'``
was silently ignored by flex on the CPU)."""

import pytest
import yaml

from nbhelpers.engine.runner_options import RunnerOptions


@pytest.mark.parametrize("text,name,word_ok", [
    ("{pdl: on}", "pdl", True), ("{pdl: off}", "pdl", True), ("{pdl: yes}", "pdl", False),
    ("{fused_elementwise: off}", "fused_elementwise", True),
    ("{l2_prefetch: off}", "l2_prefetch", True)])
def test_a_yaml_boolean_for_a_word_option_says_to_quote_it(text, name, word_ok):
    opts = yaml.safe_load(text)
    assert isinstance(opts[name], bool)  # what PyYAML (the runner's -p) makes of the word
    word = "on" if opts[name] else "off"
    with pytest.raises(ValueError, match=(rf"RunnerOptions\.{name}={opts[name]!r}: must be one "
                                          rf"of .* {name} got a boolean: YAML .* quote the word, "
                                          rf"e\.g\. \{{{name}: '{word}'\}} rather than "
                                          rf"\{{{name}: {word}\}}\.$")):
        RunnerOptions(**opts)
    quoted = yaml.safe_load(text.replace(": ", ": '").replace("}", "'}"))
    if word_ok:  # quoted, the word is the option's value
        assert getattr(RunnerOptions(**quoted), name) == quoted[name]


def test_other_bad_values_keep_their_message():
    with pytest.raises(ValueError) as err:
        RunnerOptions(pdl="Early")
    assert str(err.value) == ("RunnerOptions.pdl='Early': must be one of ('auto', 'off', 'on', "
                              "'early', 'prefetch').")
    with pytest.raises(ValueError, match=r"page_size=True: must be an int >= 1\.$"):
        RunnerOptions(page_size=True)  # an int option: no quoting hint


@pytest.mark.parametrize("field", ["decode_kernel_options", "prefill_kernel_options"])
def test_an_engine_option_inside_kernel_options_is_refused(field):
    with pytest.raises(ValueError, match=(rf"RunnerOptions\.{field}=.*\['pdl', 'sample_kernel'\] "
                                          r"are engine options, not kernel options: pass them "
                                          r"as options of their own \(LLM\(model, pdl='early', "
                                          r"sample_kernel='torch'\)")):
        RunnerOptions(**{field: {"pdl": "early", "sample_kernel": "torch", "num_warps": 4}})
    assert RunnerOptions(**{field: {"num_warps": 4}})  # kernel options alone pass


@pytest.mark.parametrize("name, value", [("use_cuda_graphs", "no"), ("compile_decode", "no"),
                                         ("fuse_lora_a", None), ("compile_attention", 1),
                                         ("compile_layers", "false")])
def test_bool_options_refuse_what_is_not_a_bool(name, value):
    """A string such as ``'no'`` is truthy: taken as is, ``use_cuda_graphs='no'`` meant True (a
    new user's probe, 2026-12-02). Each bool option takes a bool (or None where that is its
    default) and names the fix."""
    with pytest.raises(TypeError, match=rf"RunnerOptions\.{name}=.*pass True or False"):
        RunnerOptions(**{name: value})
    assert getattr(RunnerOptions(**{name: True}), name) is True
