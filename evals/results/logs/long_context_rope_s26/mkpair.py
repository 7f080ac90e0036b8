import json, os, sys
src="/work/main/vllm_ddtree/checkpoints"
name=sys.argv[1]; tcfg=json.loads(sys.argv[2]); extra=json.loads(sys.argv[3]) if len(sys.argv)>3 else {}
d=f"/tmp/ropexp/{name}"
for part in ("target","drafter"):
    os.makedirs(f"{d}/{part}", exist_ok=True)
    for f in os.listdir(f"{src}/{part}"):
        dst=f"{d}/{part}/{f}"
        if os.path.lexists(dst): os.remove(dst)
        if f=="config.json":
            c=json.load(open(f"{src}/{part}/{f}"))
            if part=="target":
                c["rope_parameters"]=tcfg; c.update(extra)
            json.dump(c, open(dst,"w"), indent=2)
        else:
            os.symlink(f"{src}/{part}/{f}", dst)
