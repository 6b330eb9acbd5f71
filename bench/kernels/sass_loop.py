#!/usr/bin/env python3
"""sass_loop.py — static SASS count of the page loop of every fp4_decode_kernel instantiation.

    cuobjdump --dump-sass BUILD/kernels/decode_sm90.o > a.sass
    bench/kernels/sass_loop.py a.sass [b.sass ...]          table: totals, then per pipe a/b/...
    bench/kernels/sass_loop.py --mix a.sass ILi128ELi1ELb0   opcode histogram of one kernel

Rows: every instantiation in any of the files (<D,MODE,NV|MX>, a trailing p for the
persistent form); '-' where a file lacks it.

The page loop is the smallest backward-branch range that holds both the stage mbarrier wait
(SYNCS...TRYWAIT) and HMMAs. Pipes as Hopper issues them: alu = the integer/logic pipe at half
rate (LOP3, SHF, PRMT, IADD3, ISETP, FMNMX, ...), fma = IMAD*/FFMA/FMUL/FADD/HMUL2/HFMA2,
mma = HMMA/MOVM, mem = LDS/LDC/..., xu = MUFU and conversions, other = uniform datapath,
branches, barriers. Static counts include the cold paths inside the loop (the refill by
thread 0, the bad-page flag), a few tens of instructions.
"""
import collections
import re
import sys

PIPES = {
    'alu': 'LOP3 LOP SHF PRMT IADD3 IADD ISETP FSETP HSETP2 SEL FSEL FMNMX IMNMX VIMNMX LEA '
           'BMSK SGXT FLO POPC BREV P2R R2P PLOP3 IABS VABSDIFF'.split(),
    'fma': 'IMAD IMUL FFMA FMUL FADD HFMA2 HMUL2 HADD2 IDP'.split(),
    'mma': 'HMMA IMMA MOVM'.split(),
    'mem': 'LDS STS LDSM LD ST LDG STG LDC ULDC ATOMS ATOM ATOMG RED'.split(),
    'xu': 'MUFU F2F F2I I2F F2FP I2FP FRND'.split(),
    'shfl': ['SHFL'],
}
OP2PIPE = {o: p for p, ops in PIPES.items() for o in ops}
ORDER = ['alu', 'fma', 'mma', 'mem', 'xu', 'shfl', 'other']


def pipe(op):
    return OP2PIPE.get(op.split('.')[0], 'other')


def parse(path):
    funcs = collections.OrderedDict()
    cur = None
    for line in open(path):
        m = re.search(r'Function : (\S+)', line)
        if m:
            cur = m.group(1)
            funcs[cur] = []
            continue
        m = re.match(r'\s+/\*([0-9a-f]{4,})\*/\s+(.*?);', line)
        if m and cur:
            toks = m.group(2).split()
            if toks and toks[0].startswith('@'):
                toks = toks[1:]
            funcs[cur].append((int(m.group(1), 16), toks[0] if toks else '', m.group(2)))
    return funcs


def page_loop(ins):
    best = None
    for a, op, text in ins:
        m = re.search(r'0x([0-9a-f]+)\s*$', text) if op.startswith('BRA') else None
        if not m or int(m.group(1), 16) > a:
            continue
        lo, hi = int(m.group(1), 16), a
        ops = [o for x, o, _ in ins if lo <= x <= hi]
        if any(o.startswith('HMMA') for o in ops) and any('TRYWAIT' in o for o in ops):
            if best is None or hi - lo < best[1] - best[0]:
                best = (lo, hi)
    return best


def summarize(path, filt=None):
    res = collections.OrderedDict()
    for f, ins in parse(path).items():
        if 'fp4_decode_kernel' not in f or (filt and filt not in f):
            continue
        lp = page_loop(ins)
        if lp:
            body = [x[1] for x in ins if lp[0] <= x[0] <= lp[1]]
            res[f] = (len(body), collections.Counter(pipe(o) for o in body),
                      collections.Counter(body))
    return res


def short(f):
    m = re.search(r'ILi(\d+)ELi(\d)ELb(\d)', f)
    return '<%s,%s,%s>%s' % (m.group(1), m.group(2), 'MX' if m.group(3) == '1' else 'NV',
                             'p' if 'persist' in f else '')


def main(argv):
    if len(argv) == 3 and argv[0] == '--mix':
        for f, (n, _, cnt) in summarize(argv[1], argv[2]).items():
            print(short(f), n)
            for op, c in cnt.most_common():
                print('  %4d %-40s %s' % (c, op, pipe(op)))
        return 0
    if not argv:
        print(__doc__)
        return 2
    rs = [summarize(p) for p in argv]
    print('| kernel | total | ' + ' | '.join(ORDER) + ' |')
    print('| --- ' * (2 + len(ORDER)) + '|')
    keys = []
    for r in rs:
        keys += [f for f in r if f not in keys]
    for f in keys:
        cells = ['/'.join(str(r[f][0]) if f in r else '-' for r in rs)]
        cells += ['/'.join(str(r[f][1].get(p, 0)) if f in r else '-' for r in rs) for p in ORDER]
        print('| %s | %s |' % (short(f), ' | '.join(cells)))
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
