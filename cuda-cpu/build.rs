//! Compiles the kernels of `host/src/model/cuda/*.cu` for the CPU: each
//! `launch/<kernel>.cpp` includes the emulator (`cuda_cpu.h`), the kernel
//! source and C entry points that launch it.

fn main() {
    let kernels = ["paged_attention", "rms_norm", "swiglu", "norm_rope", "logp_entropy", "sample"];
    let mut b = cc::Build::new();
    b.cpp(true).std("c++17").include(".").flag("-Wno-unknown-pragmas").flag("-Wno-unused-parameter");
    for k in kernels {
        b.file(format!("launch/{k}.cpp"));
        println!("cargo:rerun-if-changed=launch/{k}.cpp");
        println!("cargo:rerun-if-changed=../host/src/model/cuda/{k}.cu");
    }
    println!("cargo:rerun-if-changed=cuda_cpu.h");
    println!("cargo:rerun-if-changed=../host/src/model/cuda/common.cuh");
    b.compile("cuda_cpu_kernels");
}
