//! The `moonbright` binary: the command of `moonbright_cli::run` (its documentation lists the
//! subcommands).

use std::process::ExitCode;

fn main() -> ExitCode {
    let code = moonbright_cli::run(std::env::args_os());
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
