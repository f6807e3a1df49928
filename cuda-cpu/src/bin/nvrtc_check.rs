//! Compiles every kernel source of stapo's CUDA build with the real NVRTC and
//! ptxas, on a machine with no GPU and no driver, and reports what each
//! kernel costs on the device.
//!
//! The text, the options and the kernel names are the CUDA build's own
//! (`stapo::model::cuda::SOURCES`, [`stapo::model::cuda::NVRTC_OPTIONS`]):
//! `model::cuda_ops` compiles each source with NVRTC at run time, loads the
//! PTX into candle's device and fetches each kernel by name; the driver then
//! compiles the PTX for the GPU. Here NVRTC is loaded from the library named
//! on the command line, each kernel's `.entry` is looked up in the PTX, and
//! ptxas compiles the PTX for each architecture asked (as the driver does when
//! the module loads), printing registers, spills, stack and shared memory per
//! kernel. A launch that cannot run (registers x threads over the register
//! file, shared memory over what a block may hold) fails the check; spills
//! and local memory are flagged.
//!
//!     nvrtc-check --nvrtc $CUDA_ROOT/lib/libnvrtc.so.13 --ptxas $CUDA_ROOT/bin/ptxas [--arch sm_90 --arch sm_80] [--ptx DIR]
//!
//! The last line reads `cuda kernels through NVRTC and ptxas: K kernels x A
//! architectures, F failed, S flagged`. Exit status 1 when anything failed.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::process::Command;

use stapo::model::cuda::{Kernel, Source, NVRTC_OPTIONS, SOURCES};

type Prog = *mut c_void;

/// The NVRTC entry points used, loaded from the library at run time.
struct Nvrtc {
    _lib: libloading::Library,
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    create: unsafe extern "C" fn(
        *mut Prog,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int,
    compile: unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> c_int,
    log_size: unsafe extern "C" fn(Prog, *mut usize) -> c_int,
    log: unsafe extern "C" fn(Prog, *mut c_char) -> c_int,
    ptx_size: unsafe extern "C" fn(Prog, *mut usize) -> c_int,
    ptx: unsafe extern "C" fn(Prog, *mut c_char) -> c_int,
    destroy: unsafe extern "C" fn(*mut Prog) -> c_int,
}

impl Nvrtc {
    fn load(path: &Path) -> Result<Self, String> {
        // SAFETY: loading NVRTC runs no initialisers beyond its own.
        let lib =
            unsafe { libloading::Library::new(path) }.map_err(|e| format!("{}: {e}", path.display()))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol's type is NVRTC's documented signature (nvrtc.h).
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("{}: {}: {e}", path.display(), $name))?
            };
        }
        Ok(Self {
            version: sym!("nvrtcVersion"),
            error_string: sym!("nvrtcGetErrorString"),
            create: sym!("nvrtcCreateProgram"),
            compile: sym!("nvrtcCompileProgram"),
            log_size: sym!("nvrtcGetProgramLogSize"),
            log: sym!("nvrtcGetProgramLog"),
            ptx_size: sym!("nvrtcGetPTXSize"),
            ptx: sym!("nvrtcGetPTX"),
            destroy: sym!("nvrtcDestroyProgram"),
            _lib: lib,
        })
    }

    fn check(&self, what: &str, status: c_int) -> Result<(), String> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: NVRTC returns a static string for any status.
        let msg = unsafe { CStr::from_ptr((self.error_string)(status)) }.to_string_lossy();
        Err(format!("{what}: {msg} ({status})"))
    }

    fn version(&self) -> Result<(i32, i32), String> {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two out-parameters.
        self.check("nvrtcVersion", unsafe { (self.version)(&mut major, &mut minor) })?;
        Ok((major, minor))
    }

    /// Compiles `text` as cudarc's `compile_ptx_with_opts` does (no program
    /// name, no headers, the options given): the PTX and NVRTC's log, or the
    /// log as the error.
    fn compile(&self, text: &str, options: &[&str]) -> Result<(String, String), String> {
        let src = CString::new(text).map_err(|_| "the source holds a NUL byte".to_string())?;
        let opts: Vec<CString> =
            options.iter().map(|o| CString::new(*o).expect("an option without NUL")).collect();
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Prog = std::ptr::null_mut();
        // SAFETY: `src` outlives the call; no headers.
        self.check("nvrtcCreateProgram", unsafe {
            (self.create)(&mut prog, src.as_ptr(), std::ptr::null(), 0, std::ptr::null(), std::ptr::null())
        })?;
        // SAFETY: `prog` was created above; the options outlive the call.
        let status = unsafe { (self.compile)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
        let log = self.text(prog, self.log_size, self.log);
        let out = match (self.check("nvrtcCompileProgram", status), log) {
            (Ok(()), Ok(log)) => self.text(prog, self.ptx_size, self.ptx).map(|ptx| (ptx, log)),
            (Err(e), Ok(log)) => Err(format!("{e}\n{log}")),
            (Err(e), Err(_)) | (Ok(()), Err(e)) => Err(e),
        };
        // SAFETY: destroyed once.
        let _ = unsafe { (self.destroy)(&mut prog) };
        out
    }

    /// A text that NVRTC hands out as a size, then the bytes (log, PTX).
    fn text(
        &self,
        prog: Prog,
        size: unsafe extern "C" fn(Prog, *mut usize) -> c_int,
        get: unsafe extern "C" fn(Prog, *mut c_char) -> c_int,
    ) -> Result<String, String> {
        let mut n = 0usize;
        // SAFETY: an out-parameter.
        self.check("size", unsafe { size(prog, &mut n) })?;
        let mut buf = vec![0u8; n.max(1)];
        // SAFETY: `buf` holds the `n` bytes NVRTC said it writes (the NUL included).
        self.check("text", unsafe { get(prog, buf.as_mut_ptr().cast()) })?;
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        Ok(String::from_utf8_lossy(&buf[..end]).trim_end().to_string())
    }
}

/// What ptxas reports for one entry.
#[derive(Debug, Default, Clone, Copy)]
struct Usage {
    registers: u32,
    stack: u32,
    spill_stores: u32,
    spill_loads: u32,
    smem: u32,
    barriers: u32,
}

/// The per-entry lines of `ptxas -v` (`Compiling entry function 'NAME'`,
/// `N bytes stack frame, N bytes spill stores, N bytes spill loads`,
/// `Used N registers, used N barriers, N bytes smem, ...`).
fn parse_ptxas(log: &str) -> Vec<(String, Usage)> {
    let mut out: Vec<(String, Usage)> = Vec::new();
    let number_before = |line: &str, unit: &str| -> Option<u32> {
        let i = line.find(unit)?;
        line[..i].split(|c: char| !c.is_ascii_digit()).rfind(|w| !w.is_empty())?.parse().ok()
    };
    for line in log.lines() {
        if let Some(i) = line.find("Compiling entry function '") {
            let rest = &line[i + "Compiling entry function '".len()..];
            let name = rest.split('\'').next().unwrap_or_default();
            out.push((name.to_string(), Usage::default()));
            continue;
        }
        let Some((_, u)) = out.last_mut() else { continue };
        if line.contains("bytes stack frame") {
            u.stack = number_before(line, " bytes stack frame").unwrap_or(0);
            u.spill_stores = number_before(line, " bytes spill stores").unwrap_or(0);
            u.spill_loads = number_before(line, " bytes spill loads").unwrap_or(0);
        } else if line.contains("Used ") && line.contains(" registers") {
            u.registers = number_before(line, " registers").unwrap_or(0);
            u.barriers = number_before(line, " barriers").unwrap_or(0);
            u.smem = number_before(line, " bytes smem").unwrap_or(0);
        }
    }
    out
}

/// The limits of one architecture (CUDA C Programming Guide, compute
/// capabilities table).
struct Arch {
    name: String,
    /// Shared memory one block may use (with the opt-in for dynamic memory).
    smem_per_block: u32,
    /// Shared memory of an SM at its largest carveout.
    smem_per_sm: u32,
}

impl Arch {
    fn new(name: &str) -> Result<Self, String> {
        let (per_block, per_sm) = match name {
            "sm_90" => (227 * 1024, 228 * 1024),
            "sm_80" => (163 * 1024, 164 * 1024),
            "sm_86" | "sm_89" => (99 * 1024, 100 * 1024),
            _ => return Err(format!("--arch {name}: one of sm_80, sm_86, sm_89, sm_90")),
        };
        Ok(Self { name: name.to_string(), smem_per_block: per_block, smem_per_sm: per_sm })
    }
}

/// Registers of the whole register file (per SM, and the most one block may use).
const REGISTER_FILE: u32 = 64 * 1024;
/// Static shared memory one block may declare (above it only dynamic shared memory with an opt-in).
const STATIC_SMEM: u32 = 48 * 1024;
/// Warps per SM (sm_80 and sm_90), blocks per SM (sm_80 and later).
const WARPS_PER_SM: u32 = 64;
const BLOCKS_PER_SM: u32 = 32;

/// Registers one warp holds: per-thread registers rounded up to 8 (the
/// allocation unit of 256 per warp).
fn registers_per_warp(registers: u32) -> u32 {
    (registers * 32).div_ceil(256) * 256
}

/// The launch limits `k` breaks with `u` on `arch` (empty when it can run),
/// and its theoretical occupancy (resident warps of the SM's 64) at the
/// largest shared-memory carveout.
fn limits(k: &Kernel, u: &Usage, arch: &Arch) -> (Vec<String>, u32) {
    let warps = k.threads.div_ceil(32);
    let regs_block = warps * registers_per_warp(u.registers);
    let mut broken = Vec::new();
    if regs_block > REGISTER_FILE {
        broken.push(format!(
            "{} registers x {} threads = {} > {} registers per block",
            u.registers, k.threads, regs_block, REGISTER_FILE
        ));
    }
    if u.smem > STATIC_SMEM {
        broken.push(format!("{} bytes of static shared memory > {STATIC_SMEM}", u.smem));
    }
    if u.smem > arch.smem_per_block {
        broken.push(format!("{} bytes of shared memory > {} on {}", u.smem, arch.smem_per_block, arch.name));
    }
    // Occupancy as the occupancy calculator counts it: registers per warp in
    // each of the 4 sub-partitions of 16K, 1 KiB of shared memory reserved per block.
    let by_warps = WARPS_PER_SM / warps.max(1);
    let by_regs = match registers_per_warp(u.registers) {
        0 => BLOCKS_PER_SM,
        r => (REGISTER_FILE / 4 / r) * 4 / warps.max(1),
    };
    let by_smem = arch.smem_per_sm / (u.smem + 1024);
    let blocks = by_warps.min(by_regs).min(by_smem).min(BLOCKS_PER_SM);
    (broken, blocks * warps)
}

struct Args {
    nvrtc: PathBuf,
    ptxas: PathBuf,
    arch: Vec<String>,
    ptx_dir: Option<PathBuf>,
}

fn args() -> Result<Args, String> {
    let mut a = Args { nvrtc: PathBuf::new(), ptxas: PathBuf::new(), arch: Vec::new(), ptx_dir: None };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--nvrtc" => a.nvrtc = value()?.into(),
            "--ptxas" => a.ptxas = value()?.into(),
            "--arch" => a.arch.push(value()?),
            "--ptx" => a.ptx_dir = Some(value()?.into()),
            _ => return Err(format!("unknown argument {flag}")),
        }
    }
    if a.nvrtc.as_os_str().is_empty() || a.ptxas.as_os_str().is_empty() {
        return Err("usage: nvrtc-check --nvrtc LIBNVRTC --ptxas PTXAS [--arch sm_90 ...] [--ptx DIR]".into());
    }
    if a.arch.is_empty() {
        a.arch = vec!["sm_90".into(), "sm_80".into()];
    }
    Ok(a)
}

/// The names of the PTX's `.entry` functions.
fn ptx_entries(ptx: &str) -> Vec<&str> {
    ptx.lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let rest = l.strip_prefix(".visible .entry ").or_else(|| l.strip_prefix(".entry "))?;
            rest.split('(').next().map(str::trim)
        })
        .collect()
}

/// One source through NVRTC and ptxas: its rows of the table, or why not.
struct Report {
    failed: usize,
    flagged: usize,
    rows: Vec<(String, Vec<String>)>,
}

fn check_source(
    nvrtc: &Nvrtc,
    s: &Source,
    a: &Args,
    archs: &[Arch],
    dir: &Path,
    report: &mut Report,
) -> Result<(), String> {
    let (ptx, log) = nvrtc.compile(s.text, NVRTC_OPTIONS).map_err(|e| format!("NVRTC refused it: {e}"))?;
    if !log.is_empty() {
        println!("{}: NVRTC says:\n{log}", s.file);
        report.flagged += 1;
    }
    let target = ptx.lines().find_map(|l| l.trim().strip_prefix(".target ")).unwrap_or("?").to_string();
    let entries = ptx_entries(&ptx);
    for k in s.kernels {
        if !entries.contains(&k.name) {
            return Err(format!("the PTX has no entry {} (the CUDA build fetches it by that name)", k.name));
        }
    }
    if let Some(extra) = entries.iter().find(|e| !s.kernels.iter().any(|k| k.name == **e)) {
        return Err(format!("the PTX has an entry {extra} that stapo::model::cuda does not list"));
    }
    let ptx_path = dir.join(s.file.replace(".cu", ".ptx"));
    std::fs::write(&ptx_path, &ptx).map_err(|e| format!("{}: {e}", ptx_path.display()))?;
    if let Some(keep) = &a.ptx_dir {
        std::fs::create_dir_all(keep).map_err(|e| format!("{}: {e}", keep.display()))?;
        std::fs::copy(&ptx_path, keep.join(ptx_path.file_name().expect("a file name")))
            .map_err(|e| format!("{}: {e}", keep.display()))?;
    }
    println!("{}: NVRTC ok, PTX {} bytes for {target}, entries {}", s.file, ptx.len(), entries.join(", "));
    for arch in archs {
        let cubin = dir.join(format!("{}.{}.cubin", s.file, arch.name));
        let out = Command::new(&a.ptxas)
            .arg(format!("-arch={}", arch.name))
            .arg("-v")
            .arg("-o")
            .arg(&cubin)
            .arg(&ptx_path)
            .output()
            .map_err(|e| format!("{}: {e}", a.ptxas.display()))?;
        let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        if !out.status.success() {
            return Err(format!("ptxas -arch={} refused it ({}):\n{log}", arch.name, out.status));
        }
        let usage = parse_ptxas(&log);
        for k in s.kernels {
            let Some((_, u)) = usage.iter().find(|(n, _)| n == k.name) else {
                return Err(format!("ptxas -arch={} reported nothing for {}:\n{log}", arch.name, k.name));
            };
            let (broken, warps) = limits(k, u, arch);
            let mut flags = broken.clone();
            if u.spill_stores + u.spill_loads > 0 {
                flags.push("spills".into());
            }
            if u.stack > 0 {
                flags.push(format!("{} bytes of stack (local memory)", u.stack));
            }
            if !broken.is_empty() {
                report.failed += 1;
            } else if !flags.is_empty() {
                report.flagged += 1;
            }
            report.rows.push((
                arch.name.clone(),
                vec![
                    format!("`{}`", k.name),
                    s.file.to_string(),
                    k.threads.to_string(),
                    u.registers.to_string(),
                    format!("{} / {}", u.spill_stores, u.spill_loads),
                    u.stack.to_string(),
                    u.smem.to_string(),
                    format!("{warps} / {WARPS_PER_SM}"),
                    if broken.is_empty() { flags.join("; ") } else { format!("FAILS: {}", flags.join("; ")) },
                ],
            ));
        }
    }
    Ok(())
}

fn main() {
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("nvrtc-check: {e}");
            std::process::exit(2);
        }
    };
    let nvrtc = Nvrtc::load(&a.nvrtc).unwrap_or_else(|e| {
        eprintln!("nvrtc-check: cannot load NVRTC: {e}");
        std::process::exit(2);
    });
    let archs: Vec<Arch> =
        a.arch.iter().map(|n| Arch::new(n)).collect::<Result<_, _>>().unwrap_or_else(|e| {
            eprintln!("nvrtc-check: {e}");
            std::process::exit(2);
        });
    let (major, minor) = nvrtc.version().unwrap_or_else(|e| {
        eprintln!("nvrtc-check: {e}");
        std::process::exit(2);
    });
    let ptxas_version = Command::new(&a.ptxas)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().last().unwrap_or_default().to_string())
        .unwrap_or_else(|e| {
            eprintln!("nvrtc-check: {}: {e}", a.ptxas.display());
            std::process::exit(2);
        });
    println!(
        "NVRTC {major}.{minor} ({}), options {NVRTC_OPTIONS:?}; ptxas: {ptxas_version}",
        a.nvrtc.display()
    );
    let dir = std::env::temp_dir().join(format!("stapo-nvrtc-check-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("nvrtc-check: {}: {e}", dir.display());
        std::process::exit(2);
    }
    let mut report = Report { failed: 0, flagged: 0, rows: Vec::new() };
    let mut kernels = 0;
    for s in SOURCES {
        kernels += s.kernels.len();
        if let Err(e) = check_source(&nvrtc, s, &a, &archs, &dir, &mut report) {
            println!("{}: FAILED: {e}", s.file);
            report.failed += s.kernels.len() * archs.len();
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    for arch in &archs {
        println!("\n{}: registers, spill stores / loads (bytes), stack (bytes), static shared memory (bytes), theoretical occupancy (resident warps per SM)\n", arch.name);
        println!("| kernel | source | threads | registers | spills (st / ld) | stack | shared | occupancy | flags |");
        println!("|---|---|---|---|---|---|---|---|---|");
        for (_, row) in report.rows.iter().filter(|(n, _)| *n == arch.name) {
            println!("| {} |", row.join(" | "));
        }
    }
    println!(
        "\ncuda kernels through NVRTC and ptxas: {kernels} kernels x {} architectures, {} failed, {} flagged",
        archs.len(),
        report.failed,
        report.flagged
    );
    if report.failed > 0 {
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_ptxas_verbose_output() {
        let log = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'k_a' for 'sm_90'\n\
ptxas info    : Function properties for k_a\n\
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
ptxas info    : Used 40 registers, used 1 barriers, 8320 bytes smem, 400 bytes cmem[0]\n\
ptxas info    : Compiling entry function 'k_b' for 'sm_90'\n\
ptxas info    : Function properties for k_b\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 255 registers, used 0 barriers, 380 bytes cmem[0]\n";
        let u = parse_ptxas(log);
        assert_eq!(u.len(), 2);
        assert_eq!(u[0].0, "k_a");
        let a = u[0].1;
        assert_eq!(
            (a.registers, a.barriers, a.smem, a.stack, a.spill_stores, a.spill_loads),
            (40, 1, 8320, 8, 4, 12)
        );
        let b = u[1].1;
        assert_eq!((b.registers, b.smem, b.stack), (255, 0, 0));
    }

    #[test]
    fn a_block_over_the_register_file_or_static_shared_memory_fails() {
        let arch = Arch::new("sm_90").unwrap();
        let k = Kernel { name: "k", threads: 512 };
        // 129 registers round up to 136: 136 x 512 = 69,632 > 65,536.
        let (broken, _) = limits(&k, &Usage { registers: 129, ..Usage::default() }, &arch);
        assert_eq!(broken.len(), 1, "{broken:?}");
        let (broken, warps) = limits(&k, &Usage { registers: 128, ..Usage::default() }, &arch);
        assert!(broken.is_empty());
        // 128 registers: 16K per warp sub-partition / 4K per warp = 4 warps each, 16 warps: one block.
        assert_eq!(warps, 16);
        let (broken, _) = limits(&k, &Usage { registers: 32, smem: 49 * 1024, ..Usage::default() }, &arch);
        assert_eq!(broken.len(), 1, "{broken:?}");
    }

    #[test]
    fn occupancy_is_bounded_by_warps_registers_and_shared_memory() {
        let arch = Arch::new("sm_80").unwrap();
        let k = Kernel { name: "k", threads: 256 };
        // 32 registers: 8 blocks of 8 warps fill the 64 warps.
        assert_eq!(limits(&k, &Usage { registers: 32, ..Usage::default() }, &arch).1, 64);
        // 64 registers: 2048 per warp, 8 warps per sub-partition, 32 per SM: 4 blocks.
        assert_eq!(limits(&k, &Usage { registers: 64, ..Usage::default() }, &arch).1, 32);
        // 40 KiB of shared memory: 164 / 41 = 4 blocks.
        assert_eq!(limits(&k, &Usage { registers: 32, smem: 40 * 1024, ..Usage::default() }, &arch).1, 32);
    }

    #[test]
    fn finds_ptx_entries() {
        let ptx = ".version 9.0\n.target sm_75\n.visible .entry rms_norm_f32(\n\t.param .u64 a\n)\n.entry other (\n";
        assert_eq!(ptx_entries(ptx), ["rms_norm_f32", "other"]);
    }
}
