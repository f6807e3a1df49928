//! Data-parallel runs: the MPI communicator between real processes started by
//! `mpirun -np 2` (with `--features mpi`), and the message a binary without
//! MPI gives when an MPI launcher starts it.

use std::process::Command;

/// A binary built without MPI, started as one of several MPI ranks, stops and
/// says how to build one with MPI (instead of training N independent copies).
#[cfg(not(feature = "mpi"))]
#[test]
fn launcher_without_mpi_says_how_to_get_it() {
    let out = Command::new(env!("CARGO_BIN_EXE_stapo"))
        .args(["run", "no-such-script.rhai"])
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .output()
        .expect("start stapo");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("built without MPI"), "{err}");
    assert!(err.contains("--features mpi"), "{err}");
    // One rank is fine: nothing to split.
    let out = Command::new(env!("CARGO_BIN_EXE_stapo"))
        .args(["verify", "--gold", "2", "--pred", "2"])
        .env("OMPI_COMM_WORLD_SIZE", "1")
        .output()
        .expect("start stapo");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `mpirun -np <n> <program> <args>`, with what Open MPI needs in a container
/// (running as root, more ranks than cores).
#[cfg(feature = "mpi")]
pub fn mpirun(n: usize, program: &std::path::Path, args: &[&str]) -> Command {
    let mut c = Command::new("mpirun");
    let open_mpi = Command::new("mpirun")
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("Open MPI"))
        .unwrap_or(false);
    if open_mpi {
        c.args(["--oversubscribe", "--bind-to", "none"]);
        c.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    }
    c.args(["-np", &n.to_string()]).arg(program).args(args);
    c
}

/// Starts this test binary under `mpirun -np 2`, running only
/// [`mpi_rank_collectives`] in each rank.
#[cfg(feature = "mpi")]
#[test]
fn mpi_collectives_over_two_ranks() {
    let exe = std::env::current_exe().expect("test binary");
    let out = mpirun(
        2,
        &exe,
        &["--exact", "dist::mpi_rank_collectives", "--ignored", "--test-threads=1", "--nocapture"],
    )
    .output()
    .expect("start mpirun (install openmpi-bin)");
    let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "mpirun failed\nstdout:\n{so}\nstderr:\n{se}");
    // Both ranks ran the test (not filtered away).
    assert_eq!(so.matches("rank collectives ok").count(), 2, "stdout:\n{so}\nstderr:\n{se}");
}

/// One rank of [`mpi_collectives_over_two_ranks`]: every collective of the MPI
/// communicator against values computed by hand.
#[cfg(feature = "mpi")]
#[test]
#[ignore = "runs inside mpirun, started by mpi_collectives_over_two_ranks"]
fn mpi_rank_collectives() {
    use candle_core::{Device, Tensor};
    use stapo::dist;

    assert!(dist::launched_size().is_some(), "run by mpi_collectives_over_two_ranks under mpirun");
    let c = dist::init().expect("MPI init");
    assert_eq!(c.backend(), "mpi");
    assert_eq!(c.size(), 2);
    let r = c.rank();

    let mut s = [r as f64 + 0.5, 1.0];
    c.all_reduce_f64(&mut s).unwrap();
    assert_eq!(s, [2.0, 2.0]);
    let mut f = vec![r as f32; 3];
    c.all_reduce_f32(&mut f).unwrap();
    assert_eq!(f, vec![1.0; 3]);
    // Rank 0 gives one value, rank 1 three.
    let g = c.all_gather_f32(&vec![10.0 + r as f32; 1 + 2 * r]).unwrap();
    assert_eq!(g, vec![10.0, 11.0, 11.0, 11.0]);
    let b = c.all_gather_bytes(if r == 0 { b"zero" } else { b"" }).unwrap();
    assert_eq!(b, vec![b"zero".to_vec(), Vec::new()]);
    let mut msg = if r == 1 { b"rank one decides".to_vec() } else { Vec::new() };
    c.broadcast_bytes(1, &mut msg).unwrap();
    assert_eq!(msg, b"rank one decides".to_vec());
    let v: Vec<u64> = dist::broadcast_json(&*c, 0, &vec![r as u64 + 7]).unwrap();
    assert_eq!(v, vec![7]);
    c.barrier().unwrap();

    // Bucketed tensors: two buckets of a 4-element cap.
    let mut ts = vec![
        Tensor::new(&[[r as f32, 1.0], [2.0, 3.0]], &Device::Cpu).unwrap(),
        Tensor::new(&[r as f32 * 2.0; 3], &Device::Cpu).unwrap(),
    ];
    c.all_reduce_tensors(&mut ts, 4).unwrap();
    assert_eq!(ts[0].to_vec2::<f32>().unwrap(), vec![vec![1.0, 2.0], vec![4.0, 6.0]]);
    assert_eq!(ts[1].to_vec1::<f32>().unwrap(), vec![2.0; 3]);
    println!("rank collectives ok");
    dist::finalize();
}
