import collections, glob, json, os
rows = collections.defaultdict(dict)
for f in sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "r*-*.json"))):
    name = f.split("/")[-1][:-5]
    rnd, method, mode = name.split("-")
    r = json.load(open(f))
    rows[(method, rnd)][mode] = r
print("| method | round | BP s (device) | BP s (offload) | offload / device | device peak (MiB) | with offload (MiB) | tier held (MiB) | tier model (MiB) |")
print("|---|---|---|---|---|---|---|---|---|")
for (method, rnd), modes in sorted(rows.items()):
    if len(modes) < 2: continue
    p, o = modes["plain"], modes["offload"]
    print(f"| {p['method']} | {rnd} | {p['bp_seconds']:.2f} | {o['bp_seconds']:.2f} | {o['bp_seconds']/p['bp_seconds']:.3f} | "
          f"{p['peak_bytes']/2**20:.1f} | {o['peak_bytes']/2**20:.1f} | {o['host_peak_bytes']/2**20:.1f} | {o['model_host_bytes']/2**20:.1f} |")
