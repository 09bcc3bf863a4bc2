//! An error with its causes, for logs.
//!
//! Client errors put the useful part at the bottom: a TLS failure displays
//! as `HyperError: client error (Connect)`, and only its sources say
//! `invalid peer certificate: UnknownIssuer` or that the certificate is not
//! yet valid. `tracing`'s `%e` shows the top only.

use std::error::Error;
use std::fmt;

/// Displays `error: cause: cause…`, leaving out a cause whose text the
/// message before it already contains (many errors print their source).
#[derive(Debug)]
pub struct Chain<'a>(pub &'a dyn Error);

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut last = self.0.to_string();
        f.write_str(&last)?;
        let mut next = self.0.source();
        while let Some(cause) = next {
            let text = cause.to_string();
            if !last.contains(&text) {
                write!(f, ": {text}")?;
            }
            last = text;
            next = cause.source();
        }
        Ok(())
    }
}

/// `error` with its causes (see [`Chain`]).
pub fn error_chain(error: &dyn Error) -> String {
    Chain(error).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct E(&'static str, Option<Box<E>>);
    impl fmt::Display for E {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.0)
        }
    }
    impl Error for E {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            self.1.as_deref().map(|e| e as &(dyn Error + 'static))
        }
    }

    #[test]
    fn shows_every_cause_once() {
        let tls = E(
            "client error (Connect)",
            Some(Box::new(E(
                "client error (Connect)",
                Some(Box::new(E("invalid peer certificate: UnknownIssuer", None))),
            ))),
        );
        assert_eq!(
            error_chain(&tls),
            "client error (Connect): invalid peer certificate: UnknownIssuer"
        );
        assert_eq!(error_chain(&E("alone", None)), "alone");
    }
}
