"""Issue 19's codec runs side by side: loss curves, ASR resynthesis WER and a codebook ablation.

Reads each run's ``codec_log.jsonl`` (what ``python -m breezert_train.pipeline`` brings back from
a GPU call) and, where given, its ``asr_gate --codec`` report; for a codec export it also
measures, on four teacher sentences, the MR-STFT loss of the decoder fed the encoder's
unquantised latent and fed 1 + N of its codebooks (does the quantizer or the decoder limit the
codec?). Writes one JSON and one PNG::

    python -m breezert_train.codec_report --run NAME:LOG[:GATE_JSON[:CODEC_DIR]] ... \\
        --out bench/results/voice-codec-DATE.json [--note TEXT]

Must not: train (it reads what training wrote).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from breezert_bench.provenance import provenance

LOSSES = ("stft_sc", "stft_mag", "commitment", "latent_mel", "feature_match", "gen_hinge",
          "disc_hinge", "codes_restarted")
WINDOW = 250
"""Steps per averaged row of the curve."""
ABLATION_TEXTS = ("The quick brown fox jumps over the lazy dog.",
                  "She sells sea shells by the sea shore.",
                  "Please call me back when you arrive at the station.",
                  "It was a bright cold day in April.")


def read_log(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "stft_sc" in r]


def curve(rows: list[dict]) -> list[dict]:
    """Window means of every logged loss, with the window's first step and training time."""
    out = []
    for start in range(0, len(rows), WINDOW):
        window = rows[start:start + WINDOW]
        row = {"step": window[0]["step"], "time_s": round(window[0]["time_s"], 1)}
        for key in LOSSES:
            values = [r[key] for r in window if key in r]
            if values:
                row[key] = round(statistics.mean(values), 4)
        out.append(row)
    return out


def codebook_ablation(codec_dir: Path) -> dict:
    """MR-STFT (spectral convergence, log magnitude) of the teacher's audio through the codec:
    unquantised latent, then the first codebook plus 1, 2, 4, 8 and all of the rest (the first
    group holds one codebook, so ``min(num, rest)`` keeps it whole)."""
    import numpy as np
    import torch

    from breezert.loader import load_checkpoint
    from breezert_train.losses import mr_stft_loss
    from breezert_train.quantizer import VQTrainConfig, _quantize_group, group_pairs
    from breezert_train.teacher import Teacher

    ckpt = load_checkpoint(codec_dir)
    enc, dec = ckpt.codec_encoder.float().eval(), ckpt.codec.float().eval()
    teacher = Teacher(threads=2)
    clips = [teacher.synthesize(text, i).audio.astype(np.float32) / 32768
             for i, text in enumerate(ABLATION_TEXTS)]
    length = min(len(c) for c in clips) // 1920 * 1920
    wav = torch.from_numpy(np.stack([c[:length] for c in clips]))

    def through(rest: int | None) -> list[float]:
        with torch.no_grad():
            x, latent = enc.embed(wav), None
            for enc_group, dec_group, num in group_pairs(enc, dec):
                if rest is None:  # the latent the quantizer would code
                    z = enc_group.input_proj(x) if enc_group.input_proj is not None else x
                else:  # the codebooks frozen (no generator: no learning)
                    z = _quantize_group(enc_group, x, min(num, rest), VQTrainConfig(), None)[0]
                proj = dec_group.output_proj(z)
                latent = proj if latent is None else latent + proj
            y, _ = dec.decode_latent(latent, dec.new_state(wav.shape[0]))
            return [round(float(v), 4) for v in mr_stft_loss(y, wav)]

    report = {"unquantised": through(None)}
    report.update({f"1+{n}": through(n) for n in (1, 2, 4, 8, 15)})
    return {"texts": list(ABLATION_TEXTS), "seconds_each": round(length / 24000, 2),
            "stft_sc_mag": report}


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in runs.items():
        t = [r["time_s"] / 60 for r in run["curve"]]
        wer = run.get("resynthesis_mean_wer")
        label = name + (f" (WER {100 * wer:.0f} %)" if wer is not None else "")
        for ax, key in zip(axes, ("stft_sc", "stft_mag"), strict=True):
            ax.plot(t, [r[key] for r in run["curve"]], marker=".", label=label)
    for ax, key in zip(axes, ("spectral convergence", "log-magnitude L1"), strict=True):
        ax.set_xlabel("codec training time on the H200, min")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Issue 19: small codec, MR-STFT per 250 steps; WER = teacher audio resynthesised")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", required=True,
                   help="NAME:LOG[:GATE_JSON[:CODEC_DIR]] (empty fields allowed)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--note", default="")
    args = p.parse_args()
    runs = {}
    for spec in args.run:
        name, log, *rest = spec.split(":")
        rows = read_log(Path(log))
        run = {"steps": rows[-1]["step"], "train_time_s": round(rows[-1]["time_s"], 1),
               "curve": curve(rows)}
        if rest and rest[0]:
            gate = json.loads(Path(rest[0]).read_text())
            run["resynthesis_mean_wer"] = gate["mean_wer"]["resynthesis"]
            run["resynthesis_corpus_wer"] = gate["corpus_wer"]["resynthesis"]
            run["teacher_mean_wer"] = gate["mean_wer"]["offline"]
            run["gate_sentences"] = gate["num_sentences"]
        if len(rest) > 1 and rest[1]:
            run["codebook_ablation"] = codebook_ablation(Path(rest[1]))
        runs[name] = run
    report = {"what": "issue 19 codec training runs (small preset) on one H200",
              **provenance(device="cpu"),  # this report's; the runs' own machine is below
              "gpu": "NVIDIA H200 (torch 2.11 + CUDA 13 there)",
              "note": args.note, "runs": runs}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(runs, args.out.with_suffix(".png"))
    print(json.dumps({k: {kk: v for kk, v in r.items() if kk != "curve"}
                      for k, r in runs.items()}, indent=1))


if __name__ == "__main__":
    main()
