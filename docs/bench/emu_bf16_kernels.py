"""Runs stapo's AMX and AVX-512 BF16 matmul kernels (host/src/model/fused/mm_bf16.rs)
as compiled machine code in the Bochs x86 emulator and checks them against f64.

A developer tool, not part of stapo: docs/bench/emu_bf16_kernels.sh builds
the `emu-entry` cdylib, makes a throw-away virtualenv with bochscpu-python and runs
this file on it:

    python emu_bf16_kernels.py LIBSTAPO_SO

What runs where:
- The whole product of each entry (`stapo_emu_amx`, `stapo_emu_avx512bf16`: packing,
  rounding, the task loops, the kernels, the copy-out) is the library's own machine
  code, executed by Bochs (CPU model `sapphire_rapids`, long mode, ring 0, no OS).
- AVX-512 F/BW/BF16 (`vdpbf16ps`, masked loads, ...) are Bochs' implementation.
- AMX: the Bochs inside bochscpu-python 0.4.0 is built without AMX (its decoder has no
  tile instructions; LDTILECFG is #UD). Each AMX instruction of the library is therefore
  replaced by `ud2` in guest memory; its original bytes are decoded here (VEX prefix,
  ModRM, SIB: which tile and general registers the compiler chose, base, stride) and it
  is executed by the tile unit below, written from the pseudo-code of the Intel SDM
  (LDTILECFG's checks, TILELOADD/TILESTORED row by row with the SIB index as stride,
  TDPBF16PS with f32 accumulation of bf16 pairs). So for AMX this checks the machine
  code around the instructions and their encodings, not the silicon's arithmetic.
- memcpy/memmove/memset are tiny routines loaded next to the library; any other
  import of the library traps, as does any exception, and the run fails.

Every product is checked against f64 in two ways, per output and relative to
sum|x_c w_c|: against x w^T within tolerance(k) = 2^-8 + k 2^-23 (mm_bf16::tolerance:
rounding x to bf16, then the f32 accumulation), and against xr w^T, xr being x rounded
to bf16 here (round to nearest even), within k 2^-23 alone, which checks that the code
rounds x as it should. Exit status 0 when every case passes.
"""

import ctypes
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np
from elftools.elf.elffile import ELFFile
from elftools.elf.relocation import RelocationSection
from elftools.elf.sections import SymbolTableSection

import bochscpu
import bochscpu.cpu
import bochscpu.memory as mem

PAGE = 4096
BASE = 0x100_0000_0000  # where the library is loaded (guest virtual)
STUBS = 0x2000_0000  # sentinel, memcpy & co., import traps
STACK = 0x3000_0000
STACK_SIZE = 1 << 20
DATA = 0x4000_0000
DATA_SIZE = 16 << 20
PML4_GPA = 0x10_0000
# Index of `sapphire_rapids` in Bochs' CPU database (cpudb.h order); the run checks
# CPUID for AVX512_BF16 to make sure.
MODEL_SAPPHIRE_RAPIDS = 30
XCR0 = 0xE7  # x87, SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM

so = ctypes.CDLL(bochscpu._bochscpu.__file__)


def set_cpu_model(index):
    """bochscpu offers models up to tigerlake (no AVX512_BF16); Bochs has more."""
    so.sim_get_param_enum.restype = ctypes.c_void_p
    so.sim_get_param_enum.argtypes = [ctypes.c_char_p]
    p = so.sim_get_param_enum(b"cpu.model")
    set_range = so._ZN14bx_param_num_c9set_rangeEmm  # bx_param_num_c::set_range
    set_range.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    set_val = so._ZN15bx_param_enum_c3setEl  # bx_param_enum_c::set
    set_val.argtypes = [ctypes.c_void_p, ctypes.c_long]
    set_range(p, 0, 63)
    set_val(p, index)


def asm(src):
    """Assembles Intel-syntax `src` with binutils' `as`; the .text bytes."""
    with tempfile.TemporaryDirectory() as d:
        open(f"{d}/a.s", "w").write(".intel_syntax noprefix\n" + src + "\n")
        subprocess.check_call(["as", f"{d}/a.s", "-o", f"{d}/a.o"])
        subprocess.check_call(["objcopy", "-O", "binary", "-j", ".text", f"{d}/a.o", f"{d}/a.bin"])
        return open(f"{d}/a.bin", "rb").read()


class Guest:
    """Guest memory: virtual pages mapped 1:1 onto host pages, one page table."""

    def __init__(self):
        self.pt = mem.PageMapLevel4Table()
        self.hva = {}  # guest virtual page -> host address
        self.next_gpa = 0x100_0000

    def map(self, va, size):
        for p in range(va & ~(PAGE - 1), va + size, PAGE):
            if p in self.hva:
                continue
            h = mem.allocate_host_page()
            assert h, "allocate_host_page failed"
            mem.page_insert(self.next_gpa, h)
            self.pt.insert(p, self.next_gpa, 1)
            self.hva[p] = h
            self.next_gpa += PAGE

    def commit(self):
        for h, g in self.pt.commit(PML4_GPA):
            mem.page_insert(g, h)

    def write(self, va, data):
        data = bytes(data)
        off = 0
        while off < len(data):
            p = (va + off) & ~(PAGE - 1)
            o = (va + off) - p
            n = min(PAGE - o, len(data) - off)
            ctypes.memmove(self.hva[p] + o, data[off : off + n], n)
            off += n

    def read(self, va, size):
        out = bytearray()
        while len(out) < size:
            p = (va + len(out)) & ~(PAGE - 1)
            o = (va + len(out)) - p
            n = min(PAGE - o, size - len(out))
            out += ctypes.string_at(self.hva[p] + o, n)
        return bytes(out)


# ---------------------------------------------------------------------------
# The library: PT_LOAD segments at BASE, relocations, imports, AMX instructions.

STUB_SRC = """
sentinel: hlt
    jmp sentinel
.p2align 4
memcpy: mov rax, rdi
    mov rcx, rdx
    rep movsb
    ret
.p2align 4
memset: mov r9, rdi
    mov eax, esi
    mov rcx, rdx
    rep stosb
    mov rax, r9
    ret
.p2align 4
memmove: mov rax, rdi
    mov rcx, rdx
    cmp rdi, rsi
    jbe 1f
    lea rsi, [rsi + rcx - 1]
    lea rdi, [rdi + rcx - 1]
    std
    rep movsb
    cld
    ret
1:  rep movsb
    ret
.p2align 4
cpuid_probe: push rbx
    mov r8, rdi
    mov eax, 7
    xor ecx, ecx
    cpuid
    mov [r8], ebx
    mov eax, 7
    mov ecx, 1
    cpuid
    mov [r8 + 4], eax
    pop rbx
    ret
.p2align 4
traps:
"""
STUB_NAMES = ["sentinel", "memcpy", "memset", "memmove", "cpuid_probe", "traps"]


def stub_offsets():
    """Offsets of the labels of STUB_SRC, from a symbol table of the object."""
    with tempfile.TemporaryDirectory() as d:
        open(f"{d}/a.s", "w").write(".intel_syntax noprefix\n" + STUB_SRC + "\n")
        subprocess.check_call(["as", f"{d}/a.s", "-o", f"{d}/a.o"])
        out = subprocess.check_output(["nm", f"{d}/a.o"], text=True)
    offs = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] in STUB_NAMES:
            offs[parts[2]] = int(parts[0], 16)
    return offs


AMX_MNEMONICS = ("ldtilecfg", "sttilecfg", "tilezero", "tileloadd", "tileloaddt1", "tilestored",
                 "tilerelease", "tdpbf16ps", "tdpbssd", "tdpbsud", "tdpbusd", "tdpbuud", "tdpfp16ps")


class Library:
    def __init__(self, path, guest):
        self.path = path
        self.guest = guest
        self.f = ELFFile(open(path, "rb"))
        self.syms = {}
        for sec in self.f.iter_sections():
            if isinstance(sec, SymbolTableSection):
                for s in sec.iter_symbols():
                    if s["st_shndx"] != "SHN_UNDEF" and s.name:
                        self.syms[s.name] = s["st_value"]
        self.load()

    def load(self):
        g = self.guest
        segs = [s for s in self.f.iter_segments() if s["p_type"] == "PT_LOAD"]
        lo = min(s["p_vaddr"] for s in segs) & ~(PAGE - 1)
        hi = max(s["p_vaddr"] + s["p_memsz"] for s in segs)
        image = bytearray(hi - lo)
        for s in segs:
            data = s.data()
            image[s["p_vaddr"] - lo : s["p_vaddr"] - lo + len(data)] = data
        # Stubs: sentinel, memcpy/memset/memmove, then one `ud2` per other import.
        offs = stub_offsets()
        stub_code = bytearray(asm(STUB_SRC))
        assert len(stub_code) == offs["traps"], "the import traps must follow the stubs"
        self.stub = {k: STUBS + v for k, v in offs.items()}
        self.traps = {}  # trap address -> import name
        unknown = []
        for sec in self.f.iter_sections():
            if not isinstance(sec, RelocationSection):
                continue
            symtab = self.f.get_section(sec["sh_link"])
            for r in sec.iter_relocations():
                t, off = r["r_info_type"], r["r_offset"]
                add = r["r_addend"] if r.is_RELA() else 0
                sym = symtab.get_symbol(r["r_info_sym"]) if r["r_info_sym"] else None
                if t == 8:  # R_X86_64_RELATIVE
                    val = BASE + add
                elif t in (1, 6, 7):  # R_X86_64_64, GLOB_DAT, JUMP_SLOT
                    if sym["st_shndx"] != "SHN_UNDEF":
                        val = BASE + sym["st_value"] + (add if t == 1 else 0)
                    elif sym.name in ("memcpy", "memset", "memmove"):
                        val = self.stub[sym.name]
                    else:
                        addr = self.stub["traps"] + 2 * len(self.traps)
                        self.traps[addr] = sym.name
                        stub_code += b"\x0f\x0b"  # ud2
                        val = addr
                else:  # TLS and the like: nothing the entries may use
                    unknown.append(t)
                    continue
                struct.pack_into("<Q", image, off - lo, val & (2**64 - 1))
        if unknown:
            print(f"note: {len(unknown)} relocations of types {sorted(set(unknown))} left unapplied")
        # AMX instructions: decoded from the original bytes, then replaced by ud2.
        self.amx = {}
        dis = subprocess.check_output(["objdump", "-d", "-M", "intel", "--no-show-raw-insn", self.path], text=True)
        for line in dis.splitlines():
            parts = line.split("\t")
            if len(parts) < 2 or not parts[0].strip().endswith(":"):
                continue
            mnem = parts[1].split()[0] if parts[1].split() else ""
            if mnem in AMX_MNEMONICS:
                va = int(parts[0].strip()[:-1], 16)
                ins = decode_amx(image, va - lo, BASE + va)
                if ins["op"] != mnem:
                    sys.exit(f"decoder disagrees with objdump at {va:#x}: {ins['op']} vs {mnem}")
                self.amx[BASE + va] = ins
                image[va - lo : va - lo + 2] = b"\x0f\x0b"
        g.map(BASE + lo, len(image))
        g.write(BASE + lo, image)
        g.map(STUBS, len(stub_code))
        g.write(STUBS, stub_code)

    def entry(self, name):
        return BASE + self.syms[name]


# ---------------------------------------------------------------------------
# AMX: decoder for the VEX forms stapo uses, and a tile unit per the SDM.

def decode_amx(image, off, va):
    """Decodes the AMX instruction at image[off] (guest address va)."""
    b = image[off : off + 16]
    if b[0] != 0xC4:
        raise ValueError(f"AMX instruction at {va:#x} without a 3-byte VEX prefix: {b.hex()}")
    p1, p2, opc, modrm = b[1], b[2], b[3], b[4]
    r_ext, x_ext, b_ext = (~p1 >> 7) & 1, (~p1 >> 6) & 1, (~p1 >> 5) & 1
    mmmmm, w, vvvv, l_bit, pp = p1 & 0x1F, p2 >> 7, (~p2 >> 3) & 0xF, (p2 >> 2) & 1, p2 & 3
    if mmmmm != 2 or w != 0 or l_bit != 0:
        raise ValueError(f"unexpected VEX fields at {va:#x}: {b.hex()}")
    mod, reg, rm = modrm >> 6, (modrm >> 3) & 7, modrm & 7
    n = 5
    m = None
    if mod != 3:
        m = {"base": None, "index": None, "scale": 1, "disp": 0, "rip": False}
        if rm == 4:
            sib = b[5]
            n = 6
            scale, index, base = sib >> 6, ((sib >> 3) & 7) | (x_ext << 3), (sib & 7) | (b_ext << 3)
            m["scale"] = 1 << scale
            m["index"] = None if index == 4 else index
            if (sib & 7) == 5 and mod == 0:
                m["disp"] = struct.unpack_from("<i", b, n)[0]
                n += 4
            else:
                m["base"] = base
        elif rm == 5 and mod == 0:
            m["rip"] = True
            m["disp"] = struct.unpack_from("<i", b, n)[0]
            n += 4
        else:
            m["base"] = rm | (b_ext << 3)
        if mod == 1:
            m["disp"] = struct.unpack_from("<b", b, n)[0]
            n += 1
        elif mod == 2:
            m["disp"] = struct.unpack_from("<i", b, n)[0]
            n += 4
    ins = {"len": n, "mem": m, "va": va, "bytes": bytes(b[:n])}
    treg = reg | (r_ext << 3)
    if opc == 0x49 and pp == 0 and mod != 3 and reg == 0:
        ins["op"] = "ldtilecfg"
    elif opc == 0x49 and pp == 1 and mod != 3 and reg == 0:
        ins["op"] = "sttilecfg"
    elif opc == 0x49 and pp == 0 and modrm == 0xC0:
        ins["op"] = "tilerelease"
    elif opc == 0x49 and pp == 3 and mod == 3 and rm == 0:
        ins["op"], ins["dst"] = "tilezero", treg
    elif opc == 0x4B and pp == 3 and mod != 3 and rm == 4:
        ins["op"], ins["dst"] = "tileloadd", treg
    elif opc == 0x4B and pp == 1 and mod != 3 and rm == 4:
        ins["op"], ins["dst"] = "tileloaddt1", treg
    elif opc == 0x4B and pp == 2 and mod != 3 and rm == 4:
        ins["op"], ins["src"] = "tilestored", treg
    elif opc == 0x5C and pp == 2 and mod == 3:
        ins["op"], ins["dst"], ins["a"], ins["b"] = "tdpbf16ps", treg, rm | (b_ext << 3), vvvv
    else:
        ins["op"] = f"unsupported AMX opcode {b[:n].hex()}"
    for k in ("dst", "src", "a", "b"):
        if k in ins and ins[k] > 7:
            raise ValueError(f"tile register {ins[k]} at {va:#x} (#UD)")
    return ins


GPR = ["rax", "rcx", "rdx", "rbx", "rsp", "rbp", "rsi", "rdi",
       "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15"]


class Fault(Exception):
    """What the hardware would raise (#UD, #GP): the run fails."""


class TileUnit:
    """The AMX state: TILECFG (palette 1) and eight tiles of up to 16 x 64 bytes."""

    def __init__(self):
        self.release()
        self.counts = {}

    def release(self):
        self.palette = 0
        self.rows = [0] * 8
        self.colsb = [0] * 8
        self.t = np.zeros((8, 16, 64), np.uint8)

    def addr(self, ins, st):
        m = ins["mem"]
        if m["rip"]:
            return (ins["va"] + ins["len"] + m["disp"]) & (2**64 - 1)
        a = m["disp"]
        if m["base"] is not None:
            a += getattr(st, GPR[m["base"]])
        return a & (2**64 - 1)

    def stride(self, ins, st):
        m = ins["mem"]
        return 0 if m["index"] is None else getattr(st, GPR[m["index"]]) * m["scale"]

    def valid(self, t):
        if self.palette != 1:
            raise Fault("AMX instruction with no tile configuration (#UD)")
        if self.rows[t] == 0 or self.colsb[t] == 0:
            raise Fault(f"tmm{t} not configured (#UD)")

    def exec(self, ins, st, guest):
        op = ins["op"]
        self.counts[op] = self.counts.get(op, 0) + 1
        if op == "ldtilecfg":
            cfg = guest.read(self.addr(ins, st), 64)
            palette, start = cfg[0], cfg[1]
            if palette == 0:
                self.release()
                return
            if palette != 1 or any(cfg[2:16]) or any(cfg[32:48]) or any(cfg[56:64]) or start != 0:
                raise Fault(f"LDTILECFG: reserved or unsupported fields {cfg.hex()} (#GP)")
            colsb = list(struct.unpack_from("<8H", cfg, 16))
            rows = list(cfg[48:56])
            for i in range(8):
                if colsb[i] > 64 or rows[i] > 16 or (colsb[i] == 0) != (rows[i] == 0):
                    raise Fault(f"LDTILECFG: tile {i} rows {rows[i]} colsb {colsb[i]} (#GP)")
            self.release()
            self.palette, self.rows, self.colsb = 1, rows, colsb
        elif op == "tilerelease":
            self.release()
        elif op == "tilezero":
            self.valid(ins["dst"])
            self.t[ins["dst"]] = 0
        elif op in ("tileloadd", "tileloaddt1"):
            t = ins["dst"]
            self.valid(t)
            a, s = self.addr(ins, st), self.stride(ins, st)
            self.t[t] = 0
            for r in range(self.rows[t]):
                self.t[t, r, : self.colsb[t]] = np.frombuffer(guest.read(a + r * s, self.colsb[t]), np.uint8)
        elif op == "tilestored":
            t = ins["src"]
            self.valid(t)
            a, s = self.addr(ins, st), self.stride(ins, st)
            for r in range(self.rows[t]):
                guest.write(a + r * s, self.t[t, r, : self.colsb[t]].tobytes())
        elif op == "tdpbf16ps":
            d, s1, s2 = ins["dst"], ins["a"], ins["b"]
            for t in (d, s1, s2):
                self.valid(t)
            if len({d, s1, s2}) != 3:
                raise Fault("TDPBF16PS with repeated tile registers (#UD)")
            m, kk, nn = self.rows[d], self.colsb[s1] // 4, self.colsb[d] // 4
            if (self.rows[s1] != m or self.colsb[s1] != 4 * self.rows[s2] or self.colsb[d] != self.colsb[s2]
                    or self.colsb[s1] % 4 or self.colsb[d] % 4):
                raise Fault("TDPBF16PS: tile shapes do not match (#UD)")
            # Pseudo-code of the SDM: for m, k, n: tmp.fp32[n] += a.bf16[2k] * b.row[k].bf16[2n],
            # then += a.bf16[2k+1] * b.row[k].bf16[2n+1]; bf16 inputs widened with DAZ, the
            # sums in f32 with round to nearest even, denormal results flushed (FTZ).
            def bf16_to_f32(u8rows, cols):
                u16 = u8rows[:, : 4 * cols].copy().view(np.uint16).astype(np.uint32)
                f = (u16 << 16).view(np.float32)
                return np.where((u16 & 0x7F80) == 0, np.float32(0), f)  # DAZ

            acc = self.t[d, :m, : 4 * nn].copy().view(np.float32).reshape(m, nn)
            av = bf16_to_f32(self.t[s1, :m], kk)  # m x 2kk
            bv = bf16_to_f32(self.t[s2, :kk], nn)  # kk x 2nn
            for k in range(kk):
                for p in (0, 1):
                    acc = (acc + av[:, 2 * k + p, None] * bv[None, k, p::2]).astype(np.float32)
            acc[np.abs(acc) < np.finfo(np.float32).tiny] = 0  # FTZ
            self.t[d] = 0
            self.t[d, :m, : 4 * nn] = acc.view(np.uint8).reshape(m, 4 * nn)
        else:
            raise Fault(f"{op} at {ins['va']:#x}")


# ---------------------------------------------------------------------------
# Running an entry.

class Machine:
    def __init__(self, lib_path):
        set_cpu_model(MODEL_SAPPHIRE_RAPIDS)
        self.sess = bochscpu.Session()

        def missing(gpa):
            raise RuntimeError(f"guest touched unmapped physical page {gpa:#x}")

        self.sess.missing_page_handler = missing
        self.g = Guest()
        self.lib = Library(lib_path, self.g)
        self.g.map(STACK, STACK_SIZE)
        self.g.map(DATA, DATA_SIZE)
        self.g.commit()
        self.tiles = TileUnit()
        self.instructions = 0

    def state(self, rip, rdi):
        st = bochscpu.State()
        bochscpu.cpu.set_long_mode(st)
        cr0 = bochscpu.cpu.ControlRegister(st.cr0)
        cr0.MP = True
        st.cr0 = int(cr0)
        cr4 = bochscpu.cpu.ControlRegister(st.cr4)
        cr4.OSFXSR = True
        cr4.OSXMMEXCPT = True
        cr4.OSXSAVE = True
        st.cr4 = int(cr4)
        st.xcr0 = XCR0
        st.mxcsr = 0x1F80
        st.fpcw = 0x37F
        st.cr3 = PML4_GPA
        st.rflags = 0x2
        cs = bochscpu.Segment()
        cs.present, cs.selector, cs.base, cs.limit, cs.attr = True, 0x10, 0, 0xFFFFFFFF, 0x209B  # ring 0, L
        ds = bochscpu.Segment()
        ds.present, ds.selector, ds.base, ds.limit, ds.attr = True, 0x18, 0, 0xFFFFFFFF, 0xC93
        st.cs = cs
        st.ds = st.ss = st.es = st.fs = st.gs = ds
        # A call: the return address (the sentinel) at rsp, rsp + 8 16-byte aligned.
        rsp = STACK + STACK_SIZE - 72
        self.g.write(rsp, struct.pack("<Q", self.lib.stub["sentinel"]))
        st.rsp = rsp
        st.rip = rip
        st.rdi = rdi
        return st

    def call(self, rip, rdi, limit_amx=10**7):
        """Runs the function at rip(rdi) to its return; its rax."""
        self.sess.cpu.state = self.state(rip, rdi)
        events = []
        hook = bochscpu.Hook()

        def on_hlt(s, cpu_id):
            events.append(("hlt",))
            s.stop()

        def on_exc(s, cpu_id, vector, error):
            events.append(("exc", vector, error, self.sess.cpu.rip))
            s.stop()

        hook.hlt = on_hlt
        hook.exception = on_exc
        for _ in range(limit_amx):
            events.clear()
            self.sess.run([hook])
            st = self.sess.cpu.state
            if events and events[0][0] == "hlt":
                if st.rip != self.lib.stub["sentinel"] + 1:
                    raise RuntimeError(f"hlt at {st.rip - 1:#x}, not the return sentinel")
                return st.rax
            if not events or events[0][0] != "exc":
                raise RuntimeError(f"the emulator stopped without an event at {st.rip:#x}")
            _, vector, error, rip_after = events[0]
            at = rip_after - 2
            if vector == 6 and at in self.lib.amx:
                ins = self.lib.amx[at]
                self.tiles.exec(ins, st, self.g)
                st.rip = at + ins["len"]
                self.sess.cpu.state = st
                continue
            if vector == 6 and at in self.lib.traps:
                raise RuntimeError(f"the code called {self.lib.traps[at]}, an import the harness does not provide")
            raise RuntimeError(f"exception {vector} (error {error:#x}) near {rip_after:#x} "
                               f"(library offset {rip_after - BASE:#x})")
        raise RuntimeError("too many AMX instructions")

    def check_cpu(self):
        rax = self.call(self.lib.stub["cpuid_probe"], DATA)
        ebx, eax1 = struct.unpack("<II", self.g.read(DATA, 8))
        feats = {"avx512f": ebx >> 16 & 1, "avx512bw": ebx >> 30 & 1, "avx512_bf16": eax1 >> 5 & 1}
        if not all(feats.values()):
            sys.exit(f"the emulated CPU lacks {feats}: is Bochs' CPU model {MODEL_SAPPHIRE_RAPIDS} sapphire_rapids?")
        del rax
        return feats


def bf16_bits(f32):
    """f32 -> bf16 bit patterns, round to nearest even (finite inputs)."""
    u = np.asarray(f32, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def tolerance(k, round_x):
    acc = k * 2.0**-23
    return 2.0**-8 + acc if round_x else acc


def run_case(mc, entry, n, o, k, w_dtype, exact_x, rng):
    x = (rng.random((n, k)) - 0.5).astype(np.float32)
    if exact_x:
        x = bf16_value(bf16_bits(x))
    wf = (rng.random((o, k)) - 0.5).astype(np.float32)
    wbits = bf16_bits(wf)
    w_bytes = wbits.tobytes() if w_dtype == "bf16" else wf.tobytes()
    wq = bf16_value(wbits).astype(np.float64)  # the weights the kernel multiplies by
    scratch_len = (32 * -(-n // 32) + 32 * -(-o // 32)) * 32 * -(-k // 32)
    # Layout in DATA: args, x, w, y, scratch (each 64-byte aligned).
    al = lambda v: (v + 63) & ~63  # noqa: E731
    ax = DATA + 128  # after the 72 bytes of Args
    aw = al(ax + x.nbytes)
    ay = al(aw + len(w_bytes))
    asc = al(ay + 4 * n * o)
    end = asc + 2 * scratch_len
    if end > DATA + DATA_SIZE:
        raise RuntimeError(f"shape ({n}, {o}, {k}) needs more than {DATA_SIZE} bytes of guest data")
    mc.g.write(ax, x.tobytes())
    mc.g.write(aw, w_bytes)
    mc.g.write(ay, np.full(n * o, np.nan, np.float32).tobytes())
    mc.g.write(DATA, struct.pack("<QQQQQQQQQ", ax, aw, 1 if w_dtype == "f32" else 0, ay, n, o, k, asc, scratch_len))
    ret = mc.call(mc.lib.entry(entry), DATA)
    y = np.frombuffer(mc.g.read(ay, 4 * n * o), np.float32).reshape(n, o).astype(np.float64)
    if np.isnan(y).any():
        return ret, float("inf"), float("inf")

    def rel_err(xs):
        x64 = xs.astype(np.float64)
        err = np.abs(y - x64 @ wq.T) / np.maximum(np.abs(x64) @ np.abs(wq).T, np.finfo(np.float64).tiny)
        return float(err.max()) if err.size else 0.0

    return ret, rel_err(x), rel_err(bf16_value(bf16_bits(x)))


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    mc = Machine(sys.argv[1])
    feats = mc.check_cpu()
    amx_sites = {}
    for ins in mc.lib.amx.values():
        amx_sites[ins["op"]] = amx_sites.get(ins["op"], 0) + 1
    print(f"emulated CPU: Bochs sapphire_rapids, CPUID {feats}; AMX sites in the library: {amx_sites}")
    shapes = [(1, 1, 1), (1, 1, 2), (16, 16, 32), (17, 33, 33), (5, 130, 64), (40, 70, 100),
              (33, 31, 95), (3, 5, 0), (64, 64, 64), (65, 67, 129), (130, 18, 31)]
    rng = np.random.default_rng(36)
    failed = 0
    print("err: max |y - x w^T| / sum|x w| (bound 2^-8 + k 2^-23); err(xr): the same against x rounded")
    print("to bf16 here (bound k 2^-23); x bf16: x already bf16-exact")
    print(f"{'path':<12} {'shape (n, o, k)':<16} {'w':<5} {'x':<5} {'err':>10} {'bound':>10} "
          f"{'err(xr)':>10} {'bound':>10}  result")
    for entry, path in (("stapo_emu_avx512bf16", "avx512-bf16"), ("stapo_emu_amx", "amx")):
        for (n, o, k) in shapes:
            for w_dtype, exact_x in (("bf16", False), ("f32", False), ("bf16", True)):
                bound, bound_r = tolerance(k, not exact_x), tolerance(k, False)
                try:
                    ret, err, err_r = run_case(mc, entry, n, o, k, w_dtype, exact_x, rng)
                    ok = ret == 0 and err <= bound and err_r <= bound_r
                    note = "" if ret == 0 else f" (entry returned {ret})"
                except (RuntimeError, Fault) as e:
                    err, err_r, ok, note = float("nan"), float("nan"), False, f" ({e})"
                failed += not ok
                xs = "bf16" if exact_x else "f32"
                print(f"{path:<12} {str((n, o, k)):<16} {w_dtype:<5} {xs:<5} {err:>10.3e} {bound:>10.3e} "
                      f"{err_r:>10.3e} {bound_r:>10.3e}  {'ok' if ok else 'FAIL'}{note}", flush=True)
    print(f"AMX instructions executed by the harness' tile unit: {mc.tiles.counts}")
    print("all cases pass" if not failed else f"{failed} case(s) FAIL")
    sys.stdout.flush()
    os._exit(1 if failed else 0)  # skips nanobind's leak report at interpreter exit


if __name__ == "__main__":
    main()
