"""What a run's MLflow store keeps of a step's samples: the trace file (one JSON line per
sample; an MoE run's routing and a vision run's images beside it) and, for a share of them,
MLflow traces (the run's Traces tab). `TraceJob.of` runs in the loop's process and keeps only
what the store needs (JSON types, arrays, images); `TraceJob.write` runs in the run's writer
process (rlexp/tracking/writer.py), where the serialising and the store's work happen."""

from __future__ import annotations

import json
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class TraceJob:
    """One step's trace file `artifact_file` (`traces/step_00012.jsonl`): its `lines`, the MoE
    routing of line i as `routed[str(i)]`, the images of line i as `images[i]`, and `traced`:
    the lines also logged as MLflow traces."""
    artifact_file: str
    step: int
    lines: list[dict[str, Any]]
    routed: dict[str, np.ndarray]
    images: dict[int, list[Any]]
    traced: list[int]

    @classmethod
    def of(cls, samples, decode, artifact_file: str, step: int, sample_rate: float) -> TraceJob:
        """Each sample's trace line (`Sample.to_trace`: token ids, masks, logprobs, versions,
        decoded text). An MoE sample's routing goes beside the JSON, compressed binary
        (`<step>.routing.npz`, one array per line's key); a vision sample's images as PNG files
        (`<step>.images/<line>_<k>.png`), its line listing its own (`images`, in the order of
        the prompt's image parts) and where their tokens sit (`image_spans`: [start, end) token
        positions of each run of image slots). Each sample is traced with probability
        `sample_rate`, drawn from a generator seeded by the step: a rerun picks the same."""
        npz = Path(artifact_file).with_suffix(".routing.npz").name
        pictures = Path(artifact_file).with_suffix(".images").name
        lines: list[dict[str, Any]] = []
        routed: dict[str, np.ndarray] = {}
        images: dict[int, list[Any]] = {}
        for i, s in enumerate(samples):
            line = s.to_trace(decode)
            if (routing := s.trace.routed_experts) is not None:
                routed[str(i)] = routing
                line["routed_experts"] = {"file": npz, "key": str(i), "shape": list(routing.shape)}
            if found := (s.mm_infer_info or {}).get("images"):
                images[i] = list(found)
                line["images"] = [f"{pictures}/{i}_{k}.png" for k in range(len(found))]
                line["image_spans"] = s.mm_infer_info.get("spans", [])
            lines.append(line)
        rng = random.Random(step)
        traced = [i for i in range(len(lines)) if sample_rate > 0 and rng.random() < sample_rate]
        return cls(artifact_file, step, lines, routed, images, traced)

    def write(self, client, run_id: str) -> None:
        """The trace file and what goes beside it as artifacts of run `run_id`, then the
        traced lines as MLflow traces (linked to the run by the caller's tracing context)."""
        where = Path(self.artifact_file)
        client.log_text(run_id, "".join(json.dumps(line) + "\n" for line in self.lines), self.artifact_file)
        with tempfile.TemporaryDirectory() as tmp:
            if self.routed:
                npz = Path(tmp) / where.with_suffix(".routing.npz").name
                arrays: dict[str, Any] = self.routed  # numpy's stubs type **kwds as its options
                np.savez_compressed(npz, **arrays)
                client.log_artifact(run_id, str(npz), str(where.parent))
            if self.images:
                pictures = Path(tmp) / where.with_suffix(".images").name
                pictures.mkdir()
                for i, found in self.images.items():
                    for k, image in enumerate(found):
                        image.save(pictures / f"{i}_{k}.png", format="PNG")
                client.log_artifacts(run_id, str(pictures), str(where.with_suffix(".images")))
        for i in self.traced:
            log_mlflow_trace(self.lines[i], self.step)


def log_mlflow_trace(line: dict[str, Any], step: int) -> None:
    """One trajectory's trace line as an MLflow trace: the prompt in, the response and reward
    out, one child span per turn."""
    import mlflow

    with mlflow.start_span(name=f"trajectory step {step}", span_type="AGENT") as root:
        root.set_inputs({"messages": line["prompt"], "answer": line["answer"]})
        mlflow.update_current_trace(tags={"rlexp.step": str(step)})
        root.set_attributes({"rlexp.step": step, "rlexp.uid": line["uid"], "rlexp.group_id": line["group_id"],
                             "rlexp.status": line["status"], "rlexp.reward": line["reward"],
                             "rlexp.finish_reason": line["finish_reason"],
                             "rlexp.policy_version": line["policy_version"]})
        for i, turn in enumerate(line["turns"]):
            kind = "LLM" if turn.get("mask") else "TOOL" if turn.get("role") == "tool" else "UNKNOWN"
            with mlflow.start_span(name=f"turn {i}: {turn.get('role', '')}", span_type=kind) as span:
                span.set_outputs({"text": turn.get("text", "")})
                span.set_attributes({"rlexp.span": list(turn.get("span", [])),
                                     "rlexp.trained": turn.get("mask", 0)})
                if "sampling" in turn:  # what the request constrained or changed (a server's reply)
                    span.set_attributes({"rlexp.sampling": json.dumps(turn["sampling"])})
        judge = {"judge": line["judge"]} if line.get("judge") is not None else {}  # a model judge
        root.set_outputs({"response": line["response"], "reward": line["reward"],
                          "reward_components": line["reward_components"]} | judge)
