#!/bin/sh
# Put a Stowage launcher and its icon into the user's applications menu (freedesktop, no root).
#
#   packaging/install_desktop.sh              # install (after `make venv` or `pip install`)
#   packaging/install_desktop.sh --uninstall  # remove what install wrote, and the caches made for it
#
# The launcher runs the stowage-gui script by its absolute path: a menu entry does not see the
# virtualenv's PATH. STOWAGE_GUI overrides the path that is found (a relative one is taken from here).
# In a PyInstaller bundle: sh dist/stowage/_internal/packaging/install_desktop.sh (runs dist/stowage/stowage).
set -eu

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
DATA=${XDG_DATA_HOME:-$HOME/.local/share}
APPS=$DATA/applications
ICONS=$DATA/icons/hicolor
SIZES="16 24 32 48 64 128 256"

have() { command -v "$1" >/dev/null 2>&1; }

# The menu and icon caches list what their folder holds: refreshed while something else is there,
# removed with the last entry (an installer that leaves a cache of nothing behind is not uninstalled).
refresh_caches() {
    if ls "$APPS"/*.desktop >/dev/null 2>&1; then
        if have update-desktop-database; then update-desktop-database -q "$APPS" || true; fi
    else
        rm -f "$APPS/mimeinfo.cache"
    fi
    if [ -n "$(find "$ICONS" -type f ! -name icon-theme.cache 2>/dev/null | head -n 1)" ]; then
        if have gtk-update-icon-cache; then gtk-update-icon-cache -q -t "$ICONS" || true; fi
    else
        rm -f "$ICONS/icon-theme.cache"
    fi
}

if [ "${1:-}" = "--uninstall" ]; then
    rm -f "$APPS/stowage.desktop" "$ICONS/scalable/apps/stowage.svg"
    rmdir "$ICONS/scalable/apps" "$ICONS/scalable" 2>/dev/null || true
    for size in $SIZES; do
        rm -f "$ICONS/${size}x${size}/apps/stowage.png"
        rmdir "$ICONS/${size}x${size}/apps" "$ICONS/${size}x${size}" 2>/dev/null || true
    done
    refresh_caches
    echo "removed the Stowage launcher from $APPS"
    exit 0
fi

GUI=${STOWAGE_GUI:-}
if [ -z "$GUI" ]; then
    if [ -x "$ROOT/.venv/bin/stowage-gui" ]; then
        GUI=$ROOT/.venv/bin/stowage-gui
    elif [ -x "$ROOT/../stowage" ] && [ -d "$ROOT/../_internal" ]; then  # run from a PyInstaller bundle
        GUI=$(cd "$ROOT/.." && pwd)/stowage
    elif have stowage-gui; then
        GUI=$(command -v stowage-gui)
    else
        echo "stowage-gui not found: run 'make venv' (or pip install .) first, or set STOWAGE_GUI" >&2
        exit 1
    fi
fi
if [ ! -f "$GUI" ] || [ ! -x "$GUI" ]; then
    echo "no stowage-gui script at $GUI (not an executable file): nothing installed" >&2
    exit 1
fi
case $GUI in
    /*) ;;
    *) GUI=$(cd "$(dirname "$GUI")" && pwd)/$(basename "$GUI") ;;  # the menu does not start from here
esac
case $GUI in
    *'
'*) echo "the path of stowage-gui holds a line break; a launcher cannot name it: nothing installed" >&2; exit 1 ;;
esac

# Desktop entry escaping: Exec is one quoted argument (\ " ` $ escaped inside the quotes, % doubled),
# and every value then has its backslashes doubled (the string escape rule, applied first on reading).
EXEC_VALUE="\"$(printf '%s' "$GUI" | sed -e 's/[\\"`$]/\\&/g' -e 's/%/%%/g' -e 's/\\/\\\\/g')\""
TRY_VALUE=$(printf '%s' "$GUI" | sed -e 's/\\/\\\\/g')

# the checkout's assets/, or a bundle's (_internal/stowage/assets: the installed package's layout)
ASSETS=$ROOT/assets
[ -d "$ASSETS" ] || ASSETS=$ROOT/stowage/assets
mkdir -p "$APPS" "$ICONS/scalable/apps"
install -m 644 "$ASSETS/icons/stowage.svg" "$ICONS/scalable/apps/stowage.svg"
for size in $SIZES; do
    mkdir -p "$ICONS/${size}x${size}/apps"
    install -m 644 "$ASSETS/icons/stowage-$size.png" "$ICONS/${size}x${size}/apps/stowage.png"
done
# awk reads the values from the environment, so no character of the path means anything to it.
EXEC_VALUE=$EXEC_VALUE TRY_VALUE=$TRY_VALUE awk '
    $0 == "Exec=stowage-gui" { print "Exec=" ENVIRON["EXEC_VALUE"]; next }
    $0 == "TryExec=stowage-gui" { print "TryExec=" ENVIRON["TRY_VALUE"]; next }
    { print }
' "$HERE/stowage.desktop" > "$APPS/stowage.desktop.tmp"
chmod 644 "$APPS/stowage.desktop.tmp"
mv "$APPS/stowage.desktop.tmp" "$APPS/stowage.desktop"
if have desktop-file-validate && ! desktop-file-validate "$APPS/stowage.desktop" >&2; then
    rm -f "$APPS/stowage.desktop"
    echo "the launcher did not validate (above): nothing installed" >&2
    exit 1
fi

# Menus refresh on their own on most desktops; these make it immediate where the tools exist.
if have update-desktop-database; then update-desktop-database -q "$APPS" || true; fi
if have gtk-update-icon-cache; then gtk-update-icon-cache -q -t "$ICONS" || true; fi
echo "installed $APPS/stowage.desktop (runs $GUI)"
