"""Generate the shipped shipments dataset (raytrain_hybrid/assets/shipments_{train,val}.parquet).

A support ticket per row, in the shape of the design document's example: a customer's
message (``dialogue``), the parcel's tracking history (``shiptrack``), three numbers
(``feature_1`` days late, ``feature_2`` weight in kg, ``feature_3`` earlier contacts) and
``label`` = 1 when the ticket was escalated to a claim. The label is drawn from a
logistic model of all three sources (the customer's tone, a tracking exception, lateness
and repeated contacts), so neither the text alone nor the numbers alone predict it well.
The phrases vary (many templates and fillers) so that a model has to read, not match.

Run: .venv/bin/python scripts/make_shipments.py   (deterministic: seed 7)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

OUT = Path(__file__).resolve().parent.parent / "raytrain_hybrid" / "assets"
ITEMS = [
    "laptop",
    "phone case",
    "coffee grinder",
    "pair of boots",
    "textbook",
    "desk lamp",
    "blender",
    "birthday gift",
    "set of tires",
    "winter jacket",
    "camera lens",
    "printer",
    "guitar",
    "vase",
]
CITIES = [
    "Memphis",
    "Louisville",
    "Leipzig",
    "Rotterdam",
    "Chicago",
    "Dallas",
    "Lyon",
    "Toronto",
    "Denver",
    "Madrid",
    "Atlanta",
    "Hamburg",
]
# tone -> (weight in the label's logit, phrasings); {item} is filled in
DIALOGUE = {
    "angry": (
        2.2,
        [
            "This is unacceptable, my {item} is {days} days late and nobody answers my emails.",
            "I am furious. The {item} I paid for never showed up and I want my money back.",
            "Third time writing: where is my {item}? Your service is a disgrace.",
            "The box with my {item} arrived crushed and the item is broken. I demand a refund.",
            "I have been lied to twice about my {item}. Cancel it and refund me now.",
            "Worst delivery experience ever, the {item} is missing and support keeps ignoring me.",
        ],
    ),
    "worried": (
        0.8,
        [
            "Hi, my {item} was supposed to arrive already. Could you check what is going on?",
            "The tracking for my {item} has not moved in a while, is everything okay?",
            "I am a bit concerned, the {item} has not come yet and I need it this week.",
            "Could someone look into my order? The {item} seems to be stuck somewhere.",
            "Hello, any update on the {item}? It is later than the estimate you gave me.",
        ],
    ),
    "neutral": (
        -0.4,
        [
            "Hello, I would like to change the delivery address for my {item}.",
            "Can you tell me which carrier is bringing my {item}?",
            "Quick question: do I need to sign for the {item} when it arrives?",
            "Please send me the invoice for the {item} I ordered last week.",
            "Is it possible to schedule the delivery of my {item} for the afternoon?",
        ],
    ),
    "happy": (
        -1.8,
        [
            "Thanks a lot, the {item} arrived early and in perfect condition!",
            "Just wanted to say the {item} came today, great packaging, very happy.",
            "Received my {item}, everything works fine. Thank you for the quick delivery.",
            "The courier was friendly and the {item} was exactly as described. Cheers!",
            "Got the {item} yesterday, no problems at all, will order again.",
        ],
    ),
}
TONE_P = [0.2, 0.25, 0.3, 0.25]
TRACK_OK = [
    "Label created; picked up in {a}; departed {a} hub; arrived in {b}; out for delivery; delivered to front door.",
    "Shipment received in {a}; in transit to {b}; arrived at local depot; delivered, signed by resident.",
    "Picked up by courier in {a}; processed at {b} sorting center; out for delivery; delivered to mailbox.",
    "Order dispatched from {a}; customs cleared; arrived in {b}; delivered to neighbour.",
]
TRACK_DELAY = [
    "Picked up in {a}; departed {a} hub; delay: missed connection at {b}; in transit; awaiting next scan.",
    "Shipment received in {a}; held at {b} due to weather; rescheduled; in transit.",
    "Label created; picked up in {a}; arrived in {b}; delayed, operational backlog at facility.",
    "In transit from {a}; sorting delayed at {b}; estimated delivery moved by two days.",
]
TRACK_EXCEPTION = [
    "Picked up in {a}; arrived in {b}; delivery exception: address not found; returned to sender.",
    "Departed {a} hub; package damaged in handling at {b}; investigation opened.",
    "Arrived in {b}; delivery attempted, recipient unavailable; exception: package lost in transit.",
    "In transit from {a}; customs hold at {b}; exception: missing documents, shipment refused.",
]
TRACKS = [(-0.9, TRACK_OK), (0.6, TRACK_DELAY), (2.0, TRACK_EXCEPTION)]
TRACK_P = [0.5, 0.3, 0.2]


def make(n: int, rng: np.random.Generator) -> pa.Table:
    rows = {k: [] for k in ("dialogue", "shiptrack", "feature_1", "feature_2", "feature_3", "label")}
    tones = list(DIALOGUE)
    for _ in range(n):
        tone = tones[rng.choice(len(tones), p=TONE_P)]
        track = rng.choice(len(TRACKS), p=TRACK_P)
        late = float(np.clip(rng.gamma(1.5, 1.5) + (2.0 if track else 0.0) * rng.random(), 0, 14))
        weight = float(np.round(rng.lognormal(1.0, 0.8), 2))
        contacts = int(rng.poisson(0.8 + (1.2 if tone in ("angry", "worried") else 0.0)))
        t_weight, phrases = DIALOGUE[tone]
        k_weight, templates = TRACKS[track]
        a, b = rng.choice(CITIES, size=2, replace=False)
        text = phrases[rng.integers(len(phrases))].format(item=rng.choice(ITEMS), days=max(1, round(late)))
        logit = t_weight + k_weight + 0.45 * (late - 3.0) + 0.6 * (contacts - 1.0) + 0.02 * weight - 1.2
        label = int(rng.random() < 1.0 / (1.0 + np.exp(-2.0 * logit)))
        rows["dialogue"].append(text)
        rows["shiptrack"].append(templates[rng.integers(len(templates))].format(a=a, b=b))
        rows["feature_1"].append(round(late, 2))
        rows["feature_2"].append(weight)
        rows["feature_3"].append(float(contacts))
        rows["label"].append(label)
    return pa.table(rows)


def main() -> None:
    rng = np.random.default_rng(7)
    for name, n in (("train", 2000), ("val", 500)):
        table = make(n, rng)
        pq.write_table(table, OUT / f"shipments_{name}.parquet")
        pos = sum(table.column("label").to_pylist()) / n
        print(f"{name}: {n} rows, {pos:.1%} label 1 -> {OUT / f'shipments_{name}.parquet'}")


if __name__ == "__main__":
    main()
