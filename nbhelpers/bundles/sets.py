"""Pinned offline install sets for the air-gapped H200 image (data only; built by ``bundles/build.py``).

Contract: each :class:`BundleSet` names exact ``name==version`` pins for cp312 manylinux x86_64
wheels that are *missing* from the image (Python 3.12.3, torch 2.11.0+cu130, transformers 5.17.0),
the device site dir it installs into, and how it travels (``wheels``: carried as ``.whl`` files and
``pip install --target``-ed there; ``site-xz``: unpacked and trimmed here, shipped as a tar.xz split
into parts). Sets that share a ``site`` must agree on every shared pin; vllm and fa4 clash
(cutlass-dsl 4.6.0 vs >=4.6.2, apache-tvm-ffi 0.1.10 vs >=0.1.11) so each has its own site.

Source of every pin and trim: ``shared/research/gpu_stack.md`` (sections 1, 2, 3, 4, 6) and
``shared/research/vllm_0.26.0_bundle_manifest.txt`` (the 92-wheel vLLM set that ran on the H200).
The image package list is ``.library/device/KINDS.md`` (2026-11-17) and its ``pip list`` row.
"""

from __future__ import annotations

from dataclasses import dataclass


def _words(text: str) -> tuple[str, ...]:
    """Whitespace-separated words of ``text`` (keeps long pin lists compact)."""
    return tuple(text.split())


# Image packages (KINDS.md), as canonical names; versions only where a pip list showed them:
# KINDS.md's pip-list row, DESIGN.md (peft), and `pip list` on the H200 on 2026-11-30 (the rest).
IMAGE_VERSIONS: dict[str, str] = {
    "accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
    "tokenizers": "0.23.2", "torch": "2.11.0", "torchaudio": "2.11.0", "torchvision": "0.26.0",
    "transformers": "5.17.0", "triton": "3.6.0", "sentencepiece": "0.2.2", "tiktoken": "0.14.0",
    "onnx": "1.23.1", "peft": "0.21.0", "aiohttp": "3.14.3", "certifi": "2026.7.22",
    "click": "8.5.0", "einops": "0.8.2", "fsspec": "2026.7.0", "numba": "0.68.0",
    "pandas": "3.0.6", "pillow": "12.3.0", "protobuf": "7.36.2", "psutil": "7.2.2",
    "pyarrow": "25.0.1", "regex": "2026.9.3", "rich": "15.0.0", "setuptools": "81.0.0",
    "typer": "0.27.2", "typing-extensions": "4.16.0", "wheel": "0.48.0",
}
IMAGE_PACKAGES: frozenset[str] = frozenset(_words("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio
h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson
six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""))


@dataclass(frozen=True)
class WheelTrim:
    """Archive members (fnmatch globs on zip paths) dropped when a wheel is repacked."""

    package: str
    drop: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class BundleSet:
    """One pinned wheel set. ``site`` is the device install dir; ``with_sets`` share that site."""

    name: str
    pins: tuple[str, ...]
    packing: str  # "wheels" | "site-xz"
    site: str
    imports: tuple[str, ...]
    with_sets: tuple[str, ...] = ()
    trims: tuple[WheelTrim, ...] = ()
    site_remove: tuple[str, ...] = ()
    pythonpath_extra: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    excluded: tuple[str, ...] = ()  # deps left out on purpose (checked by verify's closure)
    note: str = ""

    def __post_init__(self) -> None:
        if self.packing not in ("wheels", "site-xz"):
            raise ValueError(f"{self.name}: packing must be 'wheels' or 'site-xz', "
                             f"got {self.packing!r}")
        bad = [p for p in self.pins if p.count("==") != 1]
        if bad:
            raise ValueError(f"{self.name}: pins must be 'name==version', fix {bad}")


NOTEBOOKS = BundleSet(
    name="notebooks", packing="wheels", site="/tmp/site",
    pins=("papermill==2.7.0", "nbclient==0.11.0", "nbformat==5.11.1", "jupyter_client==8.10.0",
          "jupyter_core==5.9.1", "ipykernel==7.4.0", "ipython==9.18.1", "traitlets==5.16.1",
          "tornado==6.6.1", "pyzmq==27.3.0", "debugpy==1.8.22", "comm==0.2.3",
          "matplotlib-inline==0.2.2", "nest-asyncio2==1.7.4", "jedi==0.20.1", "parso==0.8.7",
          "prompt_toolkit==3.0.53", "wcwidth==0.9.4", "pexpect==4.9.0", "ptyprocess==0.7.0",
          "stack_data==0.6.3", "asttokens==3.0.2", "executing==2.3.0", "pure_eval==0.2.4",
          "ipython_pygments_lexers==1.1.1", "platformdirs==4.14.8", "fastjsonschema==2.22.3",
          "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0",
          "rpds-py==2026.9.1", "entrypoints==0.4.2", "tenacity==9.2.1",
          # the suite on the GPU host runs in parallel workers (scripts/device/suite.py)
          "pytest-xdist==3.8.0", "execnet==2.1.2"),
    imports=("import papermill, nbclient, nbformat, jupyter_client, xdist, execnet",
             "import ipykernel.kernelapp",
             ("from jupyter_client.kernelspec import KernelSpecManager as K; "
              "assert 'python3' in K().find_kernel_specs()")),
    note="gpu_stack.md section 6: papermill nb.ipynb out.ipynb -k python3; the kernel inherits "
         "PYTHONPATH.",
)

TRL = BundleSet(
    name="trl", packing="wheels", site="/tmp/site",
    # datasets 4.8.5 (not 5.x) so unsloth accepts it; it wants fsspec<=2026.2.0 and the image's
    # fsspec version is unknown, so fsspec 2026.2.0 travels and shadows it (gpu_stack.md 2, 3).
    pins=("trl==1.15.0", "datasets==4.8.5", "dill==0.4.1", "multiprocess==0.70.19",
          "fsspec==2026.2.0", "gguf==0.19.0"),
    imports=("import trl; from trl import GRPOTrainer, GRPOConfig",
             "import datasets, gguf, fsspec; assert fsspec.__version__ == '2026.2.0'"),
    note="gpu_stack.md section 3: trl 1.15.0 is the newest unsloth 2026.10.9 accepts.",
)

_BNB_DROP = ("bitsandbytes/libbitsandbytes_cuda11*.so", "bitsandbytes/libbitsandbytes_cuda12*.so",
             "bitsandbytes/libbitsandbytes_cuda132.so", "bitsandbytes/libbitsandbytes_rocm*.so",
             "bitsandbytes/libbitsandbytes_xpu*.so")

UNSLOTH = BundleSet(
    name="unsloth", packing="wheels", site="/tmp/site", with_sets=("trl",),
    pins=("unsloth==2026.10.9", "unsloth_zoo==2026.10.9", "torchao==0.18.0",
          "cut_cross_entropy==25.1.1", "diffusers==0.42.1", "hf_transfer==0.1.9", "tyro==1.0.17",
          "msgspec==0.23.0", "pydantic==2.14.4", "pydantic_core==2.50.5",
          "typing_inspection==0.4.5", "annotated_types==0.8.0", "structlog==26.1.0",
          "json5==0.17.3", "nest_asyncio==1.6.0", "typeguard==4.6.1", "docstring_parser==0.18.0",
          "importlib_metadata==10.2.0", "lazy_importer==0.1.0", "bitsandbytes==0.50.2"),
    trims=(WheelTrim("unsloth", ("studio/*",),
                     "Studio web UI (24.8 of 27.3 MiB); unsloth/ never imports it"),
           WheelTrim("bitsandbytes", _BNB_DROP,
                     "keep only libbitsandbytes_cuda130.so (+cpu): torch 2.11.0+cu130 loads it")),
    imports=("import unsloth; from unsloth import FastLanguageModel",
             # unsloth_zoo refuses to import before unsloth ("Please install Unsloth").
             "import unsloth, unsloth_zoo, bitsandbytes, bitsandbytes.functional"),
    env=(("UNSLOTH_DISABLE_STATISTICS", "1"), ("HF_HUB_OFFLINE", "1")),
    excluded=("xformers",),
    note="gpu_stack.md section 2: xformers 0.0.35 is a cu12 build (unsloth falls back to SDPA); "
         "bitsandbytes must import even for 16-bit (DESIGN.md), else unsloth runs ldconfig.",
)

_VLLM_EXCLUDED = ("tokenspeed-triton", "tokenspeed-mla", "tilelang", "z3-solver", "pynvvideocodec",
                  "torchcodec", "humming-kernels", "nvidia-cuda-nvcc", "nvidia-nvvm",
                  "nvidia-cuda-cccl", "nvidia-cuda-crt", "nvidia-cuda-nvdisasm",
                  "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base",
                  "nvidia-cutlass-dsl-libs-core", "nvidia-cutlass-dsl-libs-cu12",
                  "nvidia-cutlass-dsl-libs-cu13", "quack-kernels", "cuda-tile")

VLLM = BundleSet(
    name="vllm", packing="site-xz", site="/tmp/vllm_site",
    pins=_words("""
agent-detector==2.0.0 annotated-types==0.8.0 anthropic==2.14.0 apache-tvm-ffi==0.1.10 astor==0.8.1
blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0 cffi==2.1.1 compressed-tensors==0.17.0
cryptography==50.0.2 cuda-python==13.4.4 depyf==0.20.0 detect-installer==0.2.1 dill==0.4.1
dnspython==2.9.2 docstring_parser==0.18.0 email-validator==2.4.0 fastapi-cli==0.0.34
fastapi-cloud-cli==0.28.0 fastapi==0.136.3 fastar==0.12.0 fastsafetensors==0.5.0
flashinfer-python==0.6.14 googleapis-common-protos==1.76.0 httpcore2==2.16.2 httptools==0.9.0
httpx2==2.16.2 ijson==3.6.0 interegular==0.3.3 jiter==0.19.0 jmespath==1.1.0
jsonschema-specifications==2025.9.1 jsonschema==4.26.0 lark==1.2.2 llguidance==1.7.6
lm-format-enforcer==0.11.3 loguru==0.7.3 mcp-types==2.3.0 mcp==2.3.0 mistral_common==1.13.1
model-hosting-container-standards==0.1.16 msgspec==0.23.0 nvidia-cudnn-frontend==1.28.0
nvtx==0.2.15 openai-harmony==0.0.8 openai==3.57.0 opentelemetry-api==1.45.2
opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2
opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-grpc==1.45.2
opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp==1.45.2
opentelemetry-proto==1.45.2 opentelemetry-sdk==1.45.2
opentelemetry-semantic-conventions-ai==0.5.1 opentelemetry-semantic-conventions==0.66b2
outlines_core==0.2.14 partial-json-parser==0.2.1.1.post7 prometheus-fastapi-instrumentator==8.1.0
pybase64==1.5.1 pycountry==26.2.16 pycparser==3.12 pydantic-extra-types==2.11.1
pydantic-settings==2.16.3 pydantic==2.14.4 pydantic_core==2.50.5 pyelftools==0.33 PyJWT==2.15.1
python-dotenv==1.2.4 python-json-logger==4.2.0 python-multipart==0.0.34 pyzmq==27.3.0
referencing==0.37.0 rich-toolkit==0.20.6 rignore==0.8.1 rpds-py==2026.9.1 sentry-sdk==2.75.0
setproctitle==1.3.8 sniffio==1.3.1 sse-starlette==3.7.0 starlette==1.10.0 supervisor==4.3.0
torch_c_dlpack_ext==0.1.5 truststore==0.10.5 typing-inspection==0.4.5 uvicorn==0.54.0
vllm==0.26.0 watchfiles==1.3.0 websockets==17.4 xgrammar==0.2.7
"""),
    site_remove=("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs",
                 "vllm/third_party/deep_gemm/_C.cpython-310-*.so",
                 "vllm/third_party/deep_gemm/_C.cpython-311-*.so",
                 "vllm/third_party/deep_gemm/_C.cpython-313-*.so",
                 "vllm/third_party/deep_gemm/_C.cpython-314-*.so",
                 "vllm/third_party/fmha_sm100"),
    imports=("from vllm import LLM, SamplingParams",
             "import vllm.v1.engine.core, vllm.v1.worker.gpu_model_runner",
             "import vllm.v1.attention.backends.flash_attn, vllm.model_executor.models.qwen3",
             "import vllm.device_allocator.cumem",  # sleep mode; needs libcuda.so.1
             ("from vllm.v1.attention.backends.fa_utils import is_fa_version_supported as f; "
              "assert f(3), 'FA3 (_vllm_fa3_C) does not load'")),
    env=(("VLLM_USE_FLASHINFER_SAMPLER", "0"), ("VLLM_NO_USAGE_STATS", "1"),
         ("HF_HUB_OFFLINE", "1")),
    excluded=_VLLM_EXCLUDED,
    note="vllm_0.26.0_bundle_manifest.txt: FA3 on sm_90; FA2 .so removed (a head size FA3 lacks "
         "breaks). For TRL colocate put the trl set's site after it on PYTHONPATH.",
)

FA4 = BundleSet(
    name="fa4", packing="site-xz", site="/tmp/fa4_site",
    pins=("flash-attn-4==4.0.0b36", "quack-kernels==0.6.5", "apache-tvm-ffi==0.1.15.post2",
          "torch-c-dlpack-ext==0.1.5", "nvidia-cutlass-dsl==4.8.1",
          "nvidia-cutlass-dsl-libs-base==4.8.1", "nvidia-cutlass-dsl-libs-core==4.8.1",
          "nvidia-cutlass-dsl-libs-cu13==4.8.1"),
    # cutlass-dsl puts `cutlass` on sys.path through a .pth file, which PYTHONPATH dirs skip.
    pythonpath_extra=("nvidia_cutlass_dsl/dsl_packages",),
    imports=("import cutlass, flash_attn.cute",
             "from transformers.utils import is_flash_attn_4_available as f; assert f()"),
    excluded=("nvidia-cutlass-dsl-libs-cu12", "nvidia-cuda-nvdisasm"),
    note="gpu_stack.md section 4: only the cu13 libs flavour is needed (driver 580).",
)

SETS: dict[str, BundleSet] = {s.name: s for s in (NOTEBOOKS, TRL, UNSLOTH, VLLM, FA4)}
