"""Test-session environment: headless matplotlib, no hub access, quiet tokenizers.

No fixtures or skips live here: GPU tests skip with their own ``pytest.mark.skipif``.
"""

import os

os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
