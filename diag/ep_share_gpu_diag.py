"""One-off diagnostic (not committed): where EP2/TP2 on one shared GPU first departs from TP1, and TP1's top-2
logprob gap there (a near-tie or a real divergence)."""
import json, os, sys
sys.path.insert(0, "test")
import requests
from server_utils import ServerProcess
model = "../shared/data/models/stories260K-moe8"
payload = {"text": ["Once upon a time", "The little dog", "Lily and Tom went to the park. They", "One day, a bird"],
           "sampling_params": {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True},
           "return_logprob": True, "top_logprobs_num": 3}
def run(extra):
    with ServerProcess(["--model-path", model, "--device", "cuda", "--chunked-prefill-size", "16", *extra], timeout=300) as s:
        r = requests.post(s.url + "/generate", json=payload, timeout=300).json()
        return [o["output_ids"] for o in r], [o["meta_info"].get("output_top_logprobs") for o in r]
want, top = run([])
confs = {"tp2": ["--tp", "2", "--tp-ranks-share-gpu"],
         "tp2_ep2_allreduce": ["--tp", "2", "--ep-size", "2", "--tp-ranks-share-gpu"],
         "ep2_nccl": ["--tp", "2", "--ep-size", "2", "--tp-ranks-share-gpu", "--moe-a2a-backend", "nccl"],
         "ep2_nccl_again": ["--tp", "2", "--ep-size", "2", "--tp-ranks-share-gpu", "--moe-a2a-backend", "nccl"]}
for name, extra in confs.items():
    got, gtop = run(extra)
    for i, (g, w) in enumerate(zip(got, want)):
        d = next((k for k in range(len(w)) if g[k] != w[k]), None)
        if d is None:
            print(name, "prompt", i, "equal"); continue
        print(name, "prompt", i, "first diff at", d, "tp1", w[d], "got", g[d], "tp1 top3", top[i][d] if top[i] else None,
              "got top3", gtop[i][d] if gtop[i] else None)
