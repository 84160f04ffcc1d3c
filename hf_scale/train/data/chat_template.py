"""`--chat_template_path FILE`: a Jinja chat template for a tokenizer without one (a base model), or in
place of the tokenizer's own.

The file is read and compiled with transformers' own Jinja environment (the one `apply_chat_template`
renders with, `{% generation %}` included) before anything is loaded, then set as
`tokenizer.chat_template` before tokenization. `save_pretrained` writes it as `chat_template.jinja`
with the tokenizer, so the final model and every checkpoint (hence `hf-scale export`) carry it.
Whether completion-only loss finds its `{% generation %}` markers is checked with the data
(hf_scale.train.data.formats), which knows whether the rows are chats.
"""

from __future__ import annotations

from hf_scale.errors import UserError
from hf_scale.files.reading import read_text

FLAG = "--chat_template_path"
MAX_TEMPLATE_BYTES = 2**20
"""Chat templates are a few KiB (the largest public ones ~20 KiB); a larger file is not one."""


def read_chat_template(path: str) -> str:
    """The template's text; one-line errors for a missing, unreadable, empty or non-Jinja file."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    text = read_text(path, FLAG, max_bytes=MAX_TEMPLATE_BYTES, expected="a Jinja chat template file")
    if not text.strip():
        raise UserError(f"{FLAG} {path}: the file is empty; it must hold a Jinja chat template")
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateError as error:
        line = f" (line {error.lineno})" if getattr(error, "lineno", None) else ""
        raise UserError(f"{FLAG} {path}: not a valid Jinja template: {error.message or error}{line}") from None
    return text

