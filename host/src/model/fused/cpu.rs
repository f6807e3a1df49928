//! What this CPU can run, checked once: its SIMD paths ([`Path`], best
//! first), its features ([`features`]), the kernel's permission for AMX
//! tiles ([`permit_amx`]), and the weight types the kernels read
//! (`Weight`). The kernels ([`super::mm_bf16`], [`super::simd`]) read
//! these; the choice among the paths ([`super::simd::selection`]) runs the
//! kernels' self-check, so it sits above them and this file below both.

use std::sync::OnceLock;

use half::bf16;

/// A SIMD path of the CPU, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// AMX tiles (`amx_bf16`, `tdpbf16ps`): the bf16 products of [`super::mm_bf16`].
    Amx,
    /// AVX-512 BF16 (`vdpbf16ps`): the same products, when `STAPO_CPU_PATH` names it.
    Avx512Bf16,
    /// AVX-512F: the f32 gemv's register tiles ([`super::gemv`]).
    Avx512,
    /// AVX2 + FMA: 8-lane f32 FMA; bf16 widened by a shift in registers.
    Avx2,
    /// Plain Rust, for any CPU.
    Portable,
}

impl Path {
    /// The name the benchmarks print (and [`super::simd::ENV`] takes).
    pub fn name(self) -> &'static str {
        match self {
            Path::Amx => "amx",
            Path::Avx512Bf16 => "avx512bf16",
            Path::Avx512 => "avx512",
            Path::Avx2 => "avx2",
            Path::Portable => "portable",
        }
    }

    /// True for the paths that round activations to bf16 and use the CPU's
    /// bf16 dot products ([`super::mm_bf16`]).
    pub fn bf16_dot(self) -> bool {
        matches!(self, Path::Amx | Path::Avx512Bf16)
    }
}

/// What the CPU offers, checked once.
#[derive(Clone, Copy, Debug)]
pub struct Features {
    /// CPUID's `amx_bf16` and `amx_tile` (the kernel's permission is separate).
    pub amx_bf16: bool,
    /// AVX-512 BF16 with AVX-512F and BW (the kernel's masked loads).
    pub avx512bf16: bool,
    /// AVX-512F.
    pub avx512f: bool,
    /// AVX2 and FMA.
    pub avx2_fma: bool,
}

/// The CPU's features (all false off x86-64).
pub fn features() -> Features {
    static F: OnceLock<Features> = OnceLock::new();
    *F.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // `is_x86_feature_detected!("amx-bf16")` is unstable in rustc 1.95:
            // CPUID leaf 7, EDX bits 22 (amx_bf16) and 24 (amx_tile).
            let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
            Features {
                amx_bf16: edx & (1 << 22) != 0 && edx & (1 << 24) != 0,
                avx512bf16: std::is_x86_feature_detected!("avx512bf16")
                    && std::is_x86_feature_detected!("avx512bw")
                    && std::is_x86_feature_detected!("avx512f"),
                avx512f: std::is_x86_feature_detected!("avx512f"),
                avx2_fma: std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            Features { amx_bf16: false, avx512bf16: false, avx512f: false, avx2_fma: false }
        }
    })
}

pub(crate) fn supports(f: Features, p: Path) -> bool {
    match p {
        Path::Amx => f.amx_bf16,
        Path::Avx512Bf16 => f.avx512bf16,
        Path::Avx512 => f.avx512f,
        Path::Avx2 => f.avx2_fma,
        Path::Portable => true,
    }
}

/// Asks Linux for the AMX tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM,
/// XFEATURE_XTILEDATA)`), process-wide; without it the first tile
/// instruction raises SIGILL.
///
/// # Errors
/// The kernel's refusal (its errno), or not Linux on x86-64.
pub fn request_amx() -> Result<(), String> {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        const SYS_ARCH_PRCTL: usize = 158;
        const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
        const XFEATURE_XTILEDATA: usize = 18;
        let ret: isize;
        // SAFETY: the arch_prctl system call with two integer arguments; it
        // reads and writes no user memory; rcx and r11 are clobbered by `syscall`.
        unsafe {
            std::arch::asm!(
                "syscall",
                inlateout("rax") SYS_ARCH_PRCTL as isize => ret,
                in("rdi") ARCH_REQ_XCOMP_PERM,
                in("rsi") XFEATURE_XTILEDATA,
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack)
            );
        }
        if ret == 0 {
            Ok(())
        } else {
            Err(format!("arch_prctl(ARCH_REQ_XCOMP_PERM) failed with errno {}", -ret))
        }
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        Err("AMX permission is requested only on Linux x86-64".into())
    }
}

/// True when AMX may run: the CPU has it and the kernel permits it (asked
/// once per process, [`permit_amx`]).
pub fn amx_ready() -> bool {
    ready(Path::Amx)
}

/// True when `p` may run here: the CPU supports it and, for AMX, the kernel
/// permits it.
pub fn ready(p: Path) -> bool {
    supports(features(), p) && (p != Path::Amx || permit_amx().is_ok())
}

/// [`request_amx`], asked once per process (the permission is the
/// process's); later calls return the first answer.
///
/// # Errors
/// The kernel's refusal, as [`request_amx`].
pub fn permit_amx() -> Result<(), String> {
    static ANSWER: OnceLock<Result<(), String>> = OnceLock::new();
    ANSWER.get_or_init(request_amx).clone()
}

/// A weight element type the kernels read: f32 or bf16, widened to f32.
pub(crate) trait Weight: Copy + Send + Sync + 'static {
    /// The value as f32 (exact for both types).
    fn f32(self) -> f32;

    /// The value as bf16 (round to nearest even for f32).
    fn bf16(self) -> bf16;

    /// The slice as bf16 when it already is.
    fn as_bf16(s: &[Self]) -> Option<&[bf16]>;

    /// Eight consecutive weights from `p`, widened to f32.
    ///
    /// # Safety
    /// The CPU has AVX2; `p..p+8` is readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl Weight for f32 {
    #[inline]
    fn f32(self) -> f32 {
        self
    }

    #[inline]
    fn bf16(self) -> bf16 {
        bf16::from_f32(self)
    }

    fn as_bf16(_: &[f32]) -> Option<&[bf16]> {
        None
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
}

impl Weight for bf16 {
    #[inline]
    fn f32(self) -> f32 {
        // bf16 is the top half of an f32: widening is exact.
        f32::from_bits((self.to_bits() as u32) << 16)
    }

    #[inline]
    fn bf16(self) -> bf16 {
        self
    }

    fn as_bf16(s: &[bf16]) -> Option<&[bf16]> {
        Some(s)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8(p: *const bf16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }
}

/// `w (bf16)` widened to f32, in parallel (the prefill and training products,
/// which go to gemm once per call).
pub fn widen(w: &[bf16]) -> Vec<f32> {
    use rayon::prelude::*;
    let mut out = vec![0f32; w.len()];
    out.par_chunks_mut(1 << 16).zip(w.par_chunks(1 << 16)).for_each(|(o, i)| {
        for (d, s) in o.iter_mut().zip(i) {
            *d = s.f32();
        }
    });
    out
}
