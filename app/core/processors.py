"""Loading a Qwen2-VL processor without its video half.

transformers builds ``Qwen2VLProcessor`` with a video processor, and its video processors need
torchvision; this project's CPU torch build has none (a PyPI torchvision does not import
beside it, docs/operations.md). Image editing (``QwenImageEditPipeline``) only
feeds images and text to the processor, so workers load the image and text halves of the very
same ``processor/`` folder (:func:`load_image_processor_only`) and hand it to the pipeline.
transformers is imported lazily (seconds to import).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

QWEN_VL_PROCESSOR = ("transformers", "Qwen2VLProcessor")
"""The ``model_index.json`` entry of a Qwen2-VL processor component."""


def video_processors_available() -> bool:
    """True when transformers can build video processors (torchvision imports)."""
    import transformers

    return hasattr(transformers, "VideoProcessorMixin")


@functools.cache
def image_only_processor_class() -> type[Any]:
    """A ``Qwen2VLProcessor`` whose parts are only the image processor and the tokenizer (no
    video processor): the same tokens, templates and ``__call__`` for text and images."""
    from transformers import ProcessorMixin, Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(
            self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any
        ) -> None:
            self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
            self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageOnlyQwen2VLProcessor


def load_image_processor_only(folder: Path) -> Any:
    """The processor saved in ``folder`` (a pipeline's ``processor/``) with its image processor
    and tokenizer only. Raises ``OSError`` when its files are missing."""
    return image_only_processor_class().from_pretrained(str(folder), local_files_only=True)
