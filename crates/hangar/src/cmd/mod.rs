//! One module per subcommand. Each exposes `Args` (clap) and `run(args)`.

pub mod store;

use std::io::ErrorKind;
use std::process::ExitCode;

/// Prints an error chain the way users read it (`error: … caused by: …`) and
/// picks the exit code. A broken pipe (`hangar sim | head`) is not a failure.
pub fn report(err: &anyhow::Error) -> ExitCode {
    let broken_pipe = err
        .chain()
        .filter_map(|e| e.downcast_ref::<std::io::Error>())
        .any(|e| e.kind() == ErrorKind::BrokenPipe);
    if broken_pipe {
        return ExitCode::SUCCESS;
    }
    eprintln!("error: {err}");
    for cause in err.chain().skip(1) {
        eprintln!("  caused by: {cause}");
    }
    ExitCode::FAILURE
}
