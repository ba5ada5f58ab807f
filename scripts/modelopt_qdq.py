"""NVIDIA Model Optimizer's ONNX PTQ (`modelopt.onnx.quantization.quantize`, int8 or fp8) on a plain fp32 graph,
calibrated on the feeds `scripts/requantize_probe.py --dump-feeds` wrote: for comparing it with int8-qdq and
fp8-qdq on the same data (docs/quality.md). Runs in a venv of its own: nvidia-modelopt[onnx] 0.47 pins
onnxruntime-gpu 1.24 and onnx 1.21 against this project's onnxruntime 1.32 and onnx 1.23:

    python3 -m venv /tmp/modelopt-venv
    /tmp/modelopt-venv/bin/pip install --no-deps nvidia-modelopt==0.47.0 torch==2.13.0+cpu
    /tmp/modelopt-venv/bin/pip install onnx==1.21.0 onnxruntime-gpu==1.24.4 onnx_graphsurgeon==0.6.1 \
        onnxconverter-common==1.16.0 onnxslim==0.1.98 onnxscript==0.7.2 onnx-ir==1.1.0 polygraphy==0.53.6 \
        numpy ml_dtypes scipy pydantic rich tqdm sympy packaging PyYAML omegaconf nvidia-ml-py safetensors \
        regex lief pulp cppimport "setuptools>=80"
    /tmp/modelopt-venv/bin/python scripts/modelopt_qdq.py GRAPH FEEDS.npz NODES.json OUT.onnx \
        --mode int8 --method entropy

Model Optimizer's ONNX int8/fp8 path is ONNX Runtime's `quantize_static` with its TensorRT settings (symmetric,
weights per channel, Q/DQ on the nodes' inputs), entropy (default) or max calibration over the whole graph, then
for fp8 the INT8 scales turned into FP8 ones. Given the same nodes as our graphs quantize (NODES.json: the weight
MatMuls, LM head and float MatMuls left out), its graph differs from ours only in how the ranges and weights
are chosen. `high_precision_dtype fp32` keeps the rest of the graph fp32, as ours, so the CPU scores compare.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("graph")
    ap.add_argument("feeds", help=".npz of calibration feeds (name/index keys, see requantize_probe.py)")
    ap.add_argument("nodes", help="JSON list of the MatMul node names to quantize")
    ap.add_argument("out")
    ap.add_argument("--mode", choices=("int8", "fp8"), default="int8")
    ap.add_argument("--method", choices=("entropy", "max"), default="entropy")
    a = ap.parse_args()

    from modelopt.onnx.quantization import quantize
    from onnxruntime.quantization import CalibrationDataReader

    data = np.load(a.feeds)
    count = 1 + max(int(k.split("/", 1)[0]) for k in data.files)
    feeds = [{k.split("/", 1)[1]: data[k] for k in data.files if int(k.split("/", 1)[0]) == i} for i in range(count)]

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(feeds)

        def get_next(self):
            return next(self.it, None)

        def rewind(self) -> None:
            self.it = iter(feeds)

    quantize(a.graph, quantize_mode=a.mode, calibration_method=a.method, calibration_data_reader=Reader(),
             calibration_eps=["cpu"], nodes_to_quantize=json.load(open(a.nodes)), op_types_to_quantize=["MatMul"],
             use_external_data_format=True, output_path=a.out, high_precision_dtype="fp32",
             enable_gemv_detection_for_trt=False, log_level="INFO")


if __name__ == "__main__":
    main()
