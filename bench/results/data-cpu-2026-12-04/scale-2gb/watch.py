import sys, time, os
# prints when the pretrain run launched after `launch` logs a step beyond `after`
launch, after = float(sys.argv[1]), int(sys.argv[2])
f, st = "reports/pretrain/loss.tsv", "time/pretrain.start"
while True:
    if os.path.exists(st) and os.path.getmtime(st) > launch and os.path.exists(f):
        start = float(open(st).read() or 0)
        if os.path.getmtime(f) > start:
            rows = [l for l in open(f).read().splitlines()[1:] if l.strip()]
            if any(int(float(l.split("\t")[0])) > after for l in rows):
                print(f"launch {launch:.3f} stage_start {start:.3f} first_step_beyond_{after} {time.time():.3f} "
                      f"from_launch {time.time()-launch:.2f}s from_stage_start {time.time()-start:.2f}s")
                break
    time.sleep(0.05)
