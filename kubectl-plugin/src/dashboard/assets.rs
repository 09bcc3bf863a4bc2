//! The page, served from the binary: plain HTML, CSS and JavaScript, no
//! build step (nothing to install for CI or for a user's machine).

pub const INDEX_HTML: &str = include_str!("assets/index.html");
pub const APP_JS: &str = include_str!("assets/app.js");
pub const APP_CSS: &str = include_str!("assets/app.css");
