//! Bindings for the opaque host-error type scripts catch ([`HostError`]):
//! printable, with its message.

use rhai::plugin::{export_module, exported_module};
use rhai::Engine;

use super::HostError;

/// Registers the `HostError` functions.
pub(super) fn register(engine: &mut Engine) {
    engine.register_global_module(exported_module!(fns).into());
}

/// The script-visible functions of a caught host failure.
#[export_module]
mod fns {
    use super::HostError;

    /// to_string(host_error) -> string
    ///
    /// The message of a host failure caught by `try/catch`. Host failures (a missing file,
    /// a bad option) are `HostError` values that only the host can raise; what a script
    /// throws stays its own value.
    ///
    /// # Example
    ///
    /// ```rhai
    /// try { load_model("nowhere") } catch (e) { if type_of(e) == "HostError" { print(e) } }
    /// ```
    #[rhai_fn(name = "to_string", pure, volatile)]
    pub fn to_string(e: &mut HostError) -> String {
        e.to_string()
    }

    /// to_debug(host_error) -> string
    ///
    /// The message, marked as a host error.
    ///
    /// # Example
    ///
    /// ```rhai
    /// try { load_model("nowhere") } catch (e) { debug(e) }
    /// ```
    #[rhai_fn(name = "to_debug", pure, volatile)]
    pub fn to_debug(e: &mut HostError) -> String {
        format!("HostError({:?})", e.message())
    }

    /// host_error.message -> string
    ///
    /// The message of a caught host failure.
    ///
    /// # Example
    ///
    /// ```rhai
    /// try { load_model("nowhere") } catch (e) { print(e.message) }
    /// ```
    #[rhai_fn(get = "message", pure, volatile)]
    pub fn message(e: &mut HostError) -> String {
        e.to_string()
    }
}
