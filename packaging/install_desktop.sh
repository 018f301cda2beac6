#!/bin/sh
# Put a Stowage launcher and its icon into the user's applications menu (freedesktop, no root).
#
#   packaging/install_desktop.sh              # install (after `make venv` or `pip install`)
#   packaging/install_desktop.sh --uninstall  # remove what install wrote
#
# The launcher runs the stowage-gui script by its absolute path: a menu entry does not see the
# virtualenv's PATH. STOWAGE_GUI overrides the path that is found.
set -eu

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
DATA=${XDG_DATA_HOME:-$HOME/.local/share}
APPS=$DATA/applications
ICONS=$DATA/icons/hicolor
SIZES="16 24 32 48 64 128 256"

if [ "${1:-}" = "--uninstall" ]; then
    rm -f "$APPS/stowage.desktop" "$ICONS/scalable/apps/stowage.svg"
    for size in $SIZES; do rm -f "$ICONS/${size}x${size}/apps/stowage.png"; done
    echo "removed the Stowage launcher from $APPS"
    exit 0
fi

GUI=${STOWAGE_GUI:-}
if [ -z "$GUI" ]; then
    if [ -x "$ROOT/.venv/bin/stowage-gui" ]; then
        GUI=$ROOT/.venv/bin/stowage-gui
    elif command -v stowage-gui >/dev/null 2>&1; then
        GUI=$(command -v stowage-gui)
    else
        echo "stowage-gui not found: run 'make venv' (or pip install .) first, or set STOWAGE_GUI" >&2
        exit 1
    fi
fi

mkdir -p "$APPS" "$ICONS/scalable/apps"
install -m 644 "$ROOT/assets/icons/stowage.svg" "$ICONS/scalable/apps/stowage.svg"
for size in $SIZES; do
    mkdir -p "$ICONS/${size}x${size}/apps"
    install -m 644 "$ROOT/assets/icons/stowage-$size.png" "$ICONS/${size}x${size}/apps/stowage.png"
done
# Exec and TryExec name the script; quote the path in case it holds spaces.
sed -e "s|^Exec=stowage-gui\$|Exec=\"$GUI\"|" -e "s|^TryExec=stowage-gui\$|TryExec=$GUI|" \
    "$HERE/stowage.desktop" > "$APPS/stowage.desktop"
chmod 644 "$APPS/stowage.desktop"

# Menus refresh on their own on most desktops; these make it immediate where the tools exist.
command -v update-desktop-database >/dev/null 2>&1 && update-desktop-database -q "$APPS" || true
command -v gtk-update-icon-cache >/dev/null 2>&1 && gtk-update-icon-cache -q -t "$ICONS" || true
echo "installed $APPS/stowage.desktop (runs $GUI)"
