"""How the eighteenth session's ad hoc pair folders were made (acc_64new_*.md):
    python mkpair.py NAME '<target rope_parameters JSON>' ['<extra target config JSON>']
writes /tmp/ropexp/NAME/{target,drafter} with the embedded weights linked and the
target config's rope_parameters replaced (t4d4 also had the drafter's, edited by hand).
"""

import json
import os
import sys

SRC = "/work/main/vllm_ddtree/checkpoints"
name, rope = sys.argv[1], json.loads(sys.argv[2])
extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
out = f"/tmp/ropexp/{name}"
for part in ("target", "drafter"):
    os.makedirs(f"{out}/{part}", exist_ok=True)
    for f in os.listdir(f"{SRC}/{part}"):
        dst = f"{out}/{part}/{f}"
        if os.path.lexists(dst):
            os.remove(dst)
        if f != "config.json":
            os.symlink(f"{SRC}/{part}/{f}", dst)
            continue
        config = json.load(open(f"{SRC}/{part}/{f}"))
        if part == "target":
            config["rope_parameters"] = rope
            config.update(extra)
        json.dump(config, open(dst, "w"), indent=2)
