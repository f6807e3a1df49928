//! The Rhai scripting layer: the one place that imports `rhai`.
//!
//! [`build_engine`] makes the engine used by `stapo run`, the REPL and the
//! tests alike: standard Rhai packages (no file I/O), the stapo bindings
//! (one registration file per domain under [`bindings`], modelled on
//! apollographql/router's rhai plugin), limits (operations, call depth,
//! string/array/map sizes), a cancellation check in `on_progress` (Ctrl-C)
//! with the wall-clock limits of hooks and scripts ([`shared_state::TimeLimits`]),
//! `print` routed to the session's console, and the [`resolver::Resolver`]
//! for `import "schedules" as s;`.
//!
//! The training loop lives in Rust ([`train_loop`]); scripts configure it with
//! a map and steer it through hook functions looked up by name in the current
//! [`hooks::HookSet`] at every step, which [`watch`] swaps on hot reload.
//!
//! Scripts see two constants: `SMOKE` (bool, smoke mode) and `ARGS` (map of
//! the `--set key=value` pairs, values parsed as int/float/bool/string); the
//! functions `smoke()` and `args()` return the same inside functions, which
//! cannot see top-level constants.

pub mod bindings;
pub mod convert;
pub mod error;
pub mod handles;
pub mod hooks;
pub mod resolver;
pub mod runner;
pub mod session;
pub mod shared_state;
pub mod table;
pub mod train_loop;
pub mod watch;

use std::sync::Arc;

use rhai::{Dynamic, Engine, Scope};

pub use error::{from_eval, from_parse, is_host_error, HostError};
pub use hooks::HookSet;
pub use runner::{run_file, RunOutcome};
pub use shared_state::{Console, Host, HostOptions, TimeLimits};

/// Most operations one evaluation may run (a runaway loop stops here).
pub const MAX_OPERATIONS: u64 = 500_000_000;
/// Deepest call nesting.
pub const MAX_CALL_LEVELS: usize = 64;
/// Longest string, array and map a script may build.
pub const MAX_STRING: usize = 16 << 20;
/// Longest array a script may build.
pub const MAX_ARRAY: usize = 1 << 22;
/// Largest map a script may build.
pub const MAX_MAP: usize = 1 << 16;

/// Operations between two checks of the time limits.
const DEADLINE_EVERY: u64 = 64;

/// The engine with every stapo binding, limits, console and module resolver of `host`.
pub fn build_engine(host: &Arc<Host>) -> Engine {
    let mut engine = Engine::new();
    engine
        .set_max_operations(MAX_OPERATIONS)
        .set_max_call_levels(MAX_CALL_LEVELS)
        .set_max_expr_depths(128, 64)
        .set_max_string_size(MAX_STRING)
        .set_max_array_size(MAX_ARRAY)
        .set_max_map_size(MAX_MAP)
        .set_max_modules(256);
    // `eval` would compile code the hooks, positions and limits never see.
    engine.disable_symbol("eval");
    let h = host.clone();
    engine.on_progress(move |ops| {
        if h.cancelled() {
            return Some(Dynamic::from(format!("cancelled ({})", crate::guard::signal::cause())));
        }
        // Reading the clock costs about as much as an operation: every 64th is enough.
        if ops % DEADLINE_EVERY == 0 {
            return h.deadline_passed().map(Dynamic::from);
        }
        None
    });
    let h = host.clone();
    engine.on_print(move |s| h.println(s));
    let h = host.clone();
    engine.on_debug(move |s, src, pos| {
        let at = error::format_pos(src.unwrap_or("script"), pos);
        h.println(&format!("{at}: {s}"));
    });
    engine.set_module_resolver(resolver::Resolver::new(host));
    bindings::register_all(&mut engine, host);
    engine
}

/// A scope with the constants every script sees (`SMOKE`, `ARGS`).
pub fn new_scope(host: &Host) -> Scope<'static> {
    let mut scope = Scope::new();
    scope.push_constant_dynamic("SMOKE", host.smoke_value());
    scope.push_constant_dynamic("ARGS", Dynamic::from_map(host.args_map()));
    scope
}
